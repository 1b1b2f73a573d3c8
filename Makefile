# easgd-lightning: two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true

.PHONY: venv demo test test-fast lint docs bench-cluster bench-compressors clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[dev,slurm,ft,docs]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m easgd_lightning.cli.demo

# Two pytest-xdist workers by default (run serially the suite leaves a third of two cores
# idle: tests waiting on timeouts, shaped links, SLURM); each module runs on one worker, the
# emulated-host and SLURM modules together on one worker, one cluster at a time, handed out
# first (tests/conftest.py, the suite's own scheduler). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=10 tests -m "(unit or distributed) and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check easgd_lightning tests bench scripts hydra_plugins conf build_hooks.py

# The documentation site, offline, into site/ (open site/index.html); --strict: a broken
# link, anchor or reference fails the build (mkdocs.yml, tests/e2e/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench-cluster: $(STAMP)
	$(PY) -m bench.cluster

bench-compressors: $(STAMP)
	$(PY) -m bench.compressors

clean:
	rm -rf outputs multirun runs wandb lightning_logs .pytest_cache site
