# Accelerating TensorFlow: every target sets up .venv from pyproject.toml first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-install
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.d
NB     ?= chapters/*.ipynb
FIG    ?=
LAB_ARGS ?=
# JupyterLab refuses to start as root (containers, cloud boxes) unless told it is deliberate
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
NBVAL  := --nbval --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout 120
# tests and chapters run on JOBS pytest-xdist workers (3 on 2 cores: many tests wait on child
# processes, sleeps or timeouts, and a third worker fills that idle time); a file (a notebook)
# stays on one worker,
# and each worker takes its TCP ports from its own range (conftest.py)
JOBS   ?= 3
XDIST  := -n $(JOBS) --dist loadfile
# `make execute` stores outputs only when 1-thread / 2-thread matmul time is at least this
CEILING_MIN ?= 1.3
export PYTHONHASHSEED := 0

.PHONY: help install lab test quick unit nbval execute images lint bench clean gpu-check

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 10

$(STAMP): pyproject.toml lab/overrides.json
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "setuptools>=68" wheel
	$(BIN)/python -m pip install --quiet --no-build-isolation -e ".[course,test]"
	mkdir -p $(LAB_SETTINGS) && cp lab/overrides.json $(LAB_SETTINGS)/accel-course.json
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the package with its extras

lab: $(STAMP)  ## open JupyterLab on chapters/ (headless: make lab LAB_ARGS="--no-browser --port 8899")
	$(BIN)/jupyter lab --notebook-dir=chapters $(LAB_ROOT) $(LAB_ARGS)

# chapters first: the longest files start first and the many short test files fill the end, so
# the workers finish together
test: lint  ## ruff, then the unit tests and every chapter re-run and compared by nbval
	$(BIN)/python -m pytest -q $(XDIST) $(NBVAL) $(NB) tests

quick: lint  ## between changes: ruff and the unit tests not marked slow (about 2 minutes)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" tests

unit: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest -q $(XDIST) tests

nbval: $(STAMP)  ## re-execute the chapters and compare with their stored outputs
	$(BIN)/python -m pytest -q $(XDIST) $(NBVAL) $(NB)

execute: $(STAMP)  ## store outputs: re-run notebooks in place, alone on a quiet machine (NB=chapters/01_devices.ipynb for one)
	for nb in $(NB); do \
	  $(BIN)/python -m accel ceiling --require $(CEILING_MIN) || exit 1; \
	  PYTEST_CURRENT_TEST=1 ACCEL_SAVE_FIGURES=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=300 $$nb || exit 1; done

images: $(STAMP)  ## regenerate the figures in images/ from code (FIG=10_schedules.png for one)
	$(BIN)/python -m accel images --out images $(FIG)

gpu-check: $(STAMP)  ## the GPU paths of chapters 01-08 and every Keras form of accel.parallel, on a machine with a GPU (skipped without one)
	$(BIN)/python -m pytest -v -rs -m gpu tests/gpu

lint: $(STAMP)  ## ruff over the package, tests and notebooks
	$(BIN)/ruff check accel tests chapters conftest.py

bench: $(STAMP)  ## list the benchmarks (run one: .venv/bin/python -m accel bench NAME)
	$(BIN)/python -m accel bench --list

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache
