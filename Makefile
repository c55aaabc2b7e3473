# Two commands from a fresh clone: `make demo` and `make test`. Both set up .venv themselves;
# so does `make docs` (the documentation site, built offline in strict mode into site/).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memfit-installed
DOCS_STAMP := $(VENV)/.memfit-docs-installed
BARE := .venv-bare

.PHONY: demo test test-slow docs gpu lint typecheck no-extras format clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=23.1"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,bench]"
	touch $(STAMP)

$(DOCS_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=23.1"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[docs]"
	touch $(DOCS_STAMP)

demo: $(STAMP)
	mkdir -p out
	$(VENV)/bin/memfit bench --compare --json out/bench.json --plot out/bench.png

# `make test`: all but the slow tier (tests/conftest.py: [Note: The slow tier]); CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --durations=25

# Strict: a broken link, anchor or API reference fails the build. Nothing is fetched.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The GPU validation (docs/gpu-validation.md), on a machine with a CUDA GPU and torch already
# installed (no .venv, no network): memfit runs from this tree.
gpu:
	PYTHONPATH=. $(PYTHON) -m benchmarks.gpu --out benchmarks/results

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy on memfit/ (settings in pyproject.toml [tool.mypy])
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# `pip install .` with no extras into a fresh venv, then import memfit and a one-process
# checkpoint + plan run: a dependency memfit needs but does not declare fails here.
no-extras:
	rm -rf $(BARE)
	$(PYTHON) -m venv $(BARE)
	$(BARE)/bin/python -m pip install --quiet -c constraints.txt .
	cd $(BARE) && bin/python $(CURDIR)/.ci/no_extras.py
	rm -rf $(BARE)

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(BARE) build site *.egg-info .pytest_cache .mypy_cache
