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

$(VENV)/.installed-notebook: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[notebook]'
	touch $(VENV)/.installed $@

venv: $(VENV)/.installed
venv-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/jaxspec generate "def is_prime(n):" --max-tokens 64 --compare

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
