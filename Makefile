# The course's two commands:  `make lab` (install, open JupyterLab) and `make test` (install, run every test);
# `make check` is the workshop pre-flight: is this machine ready? (one line per item, under 90 s).
# Both install into .venv/ in this folder and are idempotent: the install re-runs only when
# requirements.txt or pyproject.toml change.
PYTHON ?= python3
# pip byte-compiles every file of every package it installs (about a minute on two cores, mostly modules no lesson
# imports); with --no-compile Python compiles what is imported, once, into .venv, which needs bytecode writing on.
unexport PYTHONDONTWRITEBYTECODE
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install lab test test-fast test-bare check outputs clean

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10+ is needed (3.11 recommended); set PYTHON=python3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# Jupyter refuses to run as root unless told; containers and cloud machines often are root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: install
	$(VENV)/bin/jupyter lab $(ALLOW_ROOT) notebooks/00_start_here.ipynb

# Every test: the unit tests, each notebook once (as a learner installs it, network off, cell by cell under nbval,
# in the background while the unit tests run), the browser test. It ends with where the time went and its wall
# time, install included.
test:
	@start=$$(date +%s); status=0; \
	$(MAKE) --no-print-directory install && $(PY) -m pytest || status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s wall, install included"; exit $$status

# Contributors: the unit tests alone (no notebook, no browser, nothing marked slow), four pytest-xdist workers (more
# than two cores' worth: many tests wait on processes of their own, and a waiting worker leaves its core to another;
# each worker's torch threads share the cores), a test file to a worker (module fixtures and test_doctor's fresh
# process stay whole).
test-fast: install
	$(PY) -m pytest tests -m "not slow and not after_notebooks" -q -n 4 --dist loadfile

# The notebooks that use an optional package (bitsandbytes, torchao, peft, notebook 10's optimizers), run as installed
# in an environment without any of them: each must still run top to bottom, skipping those parts with a line. Not
# part of `make test` (minutes more); its wall time is printed at the end.
test-bare: install
	@start=$$(date +%s); status=0; \
	$(PY) -m pytest tests/test_without_optional.py -m bare -q || status=$$?; \
	echo "make test-bare: $$(( $$(date +%s) - start )) s wall"; exit $$status

check: install
	$(PY) -m course_tools.preflight --record

# Maintainers: refresh the saved outputs of NB (default: every notebook) from a profile-smoke run, then hide what a
# learner must predict first (predict cells back to None, the answers' and solutions' outputs cleared).
NB ?= notebooks/*.ipynb
outputs: install
	COURSE_PROFILE=smoke $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	  --ExecutePreprocessor.timeout=900 $(NB)
	$(PY) -m course_tools.hide_answers $(NB)

clean:
	rm -rf $(VENV) results .pytest_cache
