# `make demo` and `make test` each set up everything they need on a fresh machine (venv, torch, the package).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.libra-installed
# torchvision does not import beside torch 2.13.0: the real vision models get a venv of their own
VISION_VENV ?= .venv-vision
VISION_STAMP := $(VISION_VENV)/.libra-installed

.PHONY: demo test bench bench-quick bench-real clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench,hf,lightning,plot]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/libra demo

test: $(STAMP)
	$(PY) -m pytest -q tests

$(VISION_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VISION_VENV)
	$(VISION_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VISION_VENV)/bin/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(VISION_VENV)/bin/python -m pip install --quiet timm==1.0.31 numpy scipy
	$(VISION_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(VISION_STAMP)

# real models nobody here wrote (torchvision, timm, transformers): the budget and bit-exact gradients, ~8 minutes
bench-real: $(STAMP) $(VISION_STAMP)
	$(VISION_VENV)/bin/python bench/real_models.py --suite vision
	$(PY) bench/real_models.py --suite hf

bench: $(STAMP)
	$(PY) -m bench

bench-quick: $(STAMP)
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) $(VISION_VENV) build src/*.egg-info .pytest_cache
