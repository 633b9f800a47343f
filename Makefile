# Everything bootstraps itself: `make test` and `make lab` create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.bootstrapped
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONHASHSEED := 0

ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: help test test-all test-fast lab notebooks figures bench lock clean slides chromium serve

help:
	@echo "make test       bootstrap .venv, run unit/property tests and every notebook (nbval, strict)"
	@echo "make test-all   the same, with the slow sweeps (tests marked slow) too"
	@echo "make lab        bootstrap .venv, start JupyterLab on notebooks/ at 127.0.0.1:8888"
	@echo "make notebooks  re-execute every notebook in place (commit the outputs)"
	@echo "make figures    regenerate figures/ from the package"
	@echo "make bench      run the CPU benchmarks in benchmarks/"
	@echo "make slides     export every chapter as reveal.js slides into build/slides/"
	@echo "make serve      the OpenAI-compatible server on 127.0.0.1:8000 (dashboard at /dashboard)"

# Pinned installs: requirements-lock.txt constrains every package, torch included (the
# CPU wheel on a CPU machine). pip installs only uv (pinned too), and uv the rest: the same
# versions, in about a third of pip's time (parallel downloads, unpacking and byte-compiling;
# the .pyc files matter where PYTHONDONTWRITEBYTECODE is set). uv does not read pip's
# configuration, so the wheel folders of PIP_FIND_LINKS are passed on (this machine's CPU torch).
# The stamp makes a second run install nothing.
FIND_LINKS := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))

$(STAMP): pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements-lock.txt uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode $(FIND_LINKS) \
		-c requirements-lock.txt -e ".[dev]"
	touch $(STAMP)

# Two workers on the two cores; --dist loadfile keeps each notebook (one kernel) on one worker.
# make test leaves out the tests marked slow (long sweeps that a faster test also covers, so
# that CI stays within ten minutes); make test-all runs them too: run it before a release.
PYTEST_ALL := $(BIN)/python -m pytest tests notebooks --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -n 2 --dist loadfile

test: $(STAMP) chromium
	$(PYTEST_ALL) -m "not slow"

test-all: $(STAMP) chromium
	$(PYTEST_ALL)

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -x -q -p no:cacheprovider

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 --no-browser $(ROOT_FLAG)

notebooks: $(STAMP)
	$(BIN)/python tools/execute_notebooks.py notebooks/*.ipynb

figures: $(STAMP)
	$(BIN)/python tools/make_figures.py

# The browser tests (tests/browser/) drive Debian's Chromium; this installs it when missing
# (apt-get, as root) and otherwise only reports. It never downloads a browser of its own.
chromium:
	@sh tools/ensure_chromium.sh

# Chapter 13: the tiny model behind an OpenAI-compatible API (PORT=8000, MODEL= a checkpoint folder).
PORT ?= 8000
serve: $(STAMP)
	$(BIN)/python -m course_pkg.serve --port $(PORT) $(if $(MODEL),--model $(MODEL),) $(if $(ENGINE_CORE_PROCESS),--engine-core-process,)

slides: $(STAMP)
	$(BIN)/python tools/build_slides.py --out build/slides

bench: $(STAMP)
	$(BIN)/python benchmarks/block_manager_ops.py

lock: $(STAMP)
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu/torch==\1/' | sort -f > requirements-lock.txt

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
