# `make demo` and `make test` each set up everything they need on a fresh machine (venv, torch, the package).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.libra-installed

.PHONY: demo test bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench,hf,plot]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/libra demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m bench

bench-quick: $(STAMP)
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
