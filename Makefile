# Two tiers of tests (tests/README.md), on two stacks:
#   make test          the core tier (every capability against one device once), Python $(PYTHON)
#                      (3.11 here: jax 0.10.2, flax 0.12.8) in .venv: at most 12 minutes cold on two cores
#   make test-all      the core and the wide tier (the second optimizer over the grids, the launches of
#                      several processes, the fault runs, the docs' code, the examples, the benchmarks'
#                      smoke runs), same stack: at most 30 minutes
#   make test-latest   the core tier, the launches of several processes and the model libraries' own models
#                      (MaxText, Tunix: the `libraries` extra), Python >= 3.12 with the newest
#                      jax/flax/optax/orbax pip resolves, in .venv-latest
# Point either at another interpreter with e.g. `make test-latest PYTHON_LATEST=/opt/py3.13/bin/python3`;
# by default .ci/python-latest finds one (python3.12 on PATH, or pyenv's 3.12/3.13).
PYTHON ?= python3
PYTHON_LATEST ?= $(shell .ci/python-latest)
VENV ?= .venv
VENV_LATEST ?= .venv-latest
PY := $(VENV)/bin/python
PY_LATEST := $(VENV_LATEST)/bin/python
# Test files run in parallel, one file per worker (its compiled fixtures stay shared): as many
# workers as cores, at most 4 (each holds a JAX runtime with 8 simulated devices); the longest
# files first, in the order tests/conftest.py gives them (three workers on two cores was slower).
PYTEST_ARGS ?= -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder
STAMP := $(VENV)/.installed
STAMP_LATEST := $(VENV_LATEST)/.installed

.PHONY: setup setup-latest test test-all test-latest lint demo docs bench bench-peers clean

# `parallax` was this distribution's name before 0.2 (now `parallax-flax`): a stale install of it, or
# the parallax.egg-info its setuptools build left here, would be a second provider of `parallax`.
comma := ,
# install_venv VENV PYTHON EXTRAS: the venv, parallax installed editable with EXTRAS (comma-separated).
define install_venv
	test -x $(1)/bin/python || $(2) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip uninstall --quiet --yes parallax 2>/dev/null || true
	rm -rf parallax.egg-info
	$(1)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[$(3)]'
	bash .ci/flax-examples $(1)
	touch $(1)/.installed
endef

$(STAMP): pyproject.toml
	$(call install_venv,$(VENV),$(PYTHON),test)

$(STAMP_LATEST): pyproject.toml
	@test -n "$(PYTHON_LATEST)" || { echo "no Python >= 3.12 found: set PYTHON_LATEST=/path/to/python3.12"; exit 1; }
	$(call install_venv,$(VENV_LATEST),$(PYTHON_LATEST),test$(comma)libraries)

setup: $(STAMP)

setup-latest: $(STAMP_LATEST)

test: $(STAMP)
	$(PY) -m pytest --tier core $(PYTEST_ARGS)

# The wide tier also plans a TPU slice with the TPU compiler and GPUs with XLA's GPU compiler, without
# either device: libtpu and JAX's CUDA plugin, as the `tpu` and `gpu` extras install them (at the installed
# jax's version, so pip changes nothing else).
TARGETS_STAMP := $(VENV)/.targets-installed
$(TARGETS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet "jax[tpu,cuda12-local]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	touch $@

test-all: $(STAMP) $(TARGETS_STAMP)
	$(PY) -m pytest --tier all $(PYTEST_ARGS)

test-latest: $(STAMP_LATEST)
	$(PY_LATEST) -m pytest --tier core,launch,libraries $(PYTEST_ARGS)

# ruff as pyproject.toml configures it ([tool.ruff]), over the package, tests, benchmarks, examples and docs.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The documentation site into docs/_build/html; any warning fails the build.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -E -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

demo: $(STAMP)
	$(PY) examples/image_classifier.py --devices 8 --strategy fsdp

bench: $(STAMP)
	$(PY) -m benchmarks.run

PEERS ?= .bench-peers
# google-parallax also installs a top-level `parallax`: kept outside the venv, loaded by benchmarks/peers.py only.
bench-peers: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m pip install --quiet --upgrade --no-deps --target $(PEERS)/google_parallax 'google-parallax==0.0.2'
	$(PY) -m pip install --quiet --upgrade --no-deps --target $(PEERS)/deps 'jaxtyping>=0.2' 'wadler-lindig>=0.1.3'
	KERAS_BACKEND=jax $(PY) -m benchmarks.peers

clean:
	rm -rf $(VENV) $(VENV_LATEST) $(PEERS) build dist *.egg-info .pytest_cache docs/_build
