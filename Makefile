# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned to the local CPU build; an unpinned torch pulls gigabytes of CUDA wheels
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install install-dev demo test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH)
	$(BIN)/pip install -q -e ".[gguf,bench,server,structured]"
	@# an editable install ships no prebuilt variants: the kernel for this CPU, built now rather than at first
	@# use (without a compiler this says so, and the install goes on: leapdecode then warns at load)
	-$(BIN)/leapdecode kernels build --native
	@touch $@

install: $(STAMP)

# the ray extra too, so that tests/test_ray_serve.py runs (measured 2026-11-23 on 2 cores: ~17 s to
# install ray[serve] into an empty venv, ~30 s for the test; without ray it skips)
$(VENV)/.installed-dev: $(STAMP)
	$(BIN)/pip install -q -e ".[gguf,bench,server,structured,ray,dev]"
	@touch $@

install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/leapdecode bench --demo

# The suite runs single-threaded per test (tests/conftest.py): two pytest-xdist workers use both
# cores of a 2-core box (2026-11-27, 2 cores: 13.5 min of tests; one process took 28.7 min before
# that day's trims of the slowest tests, and was not timed after them).
# Whole files go to a worker (--dist loadfile), so module fixtures are built once.  TEST_WORKERS=0
# runs in this process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: install-dev
	$(BIN)/python -m pytest tests $(XDIST)

# One tier of the suite (tests/conftest.py gives every test one; the README says which to run when):
# `make test-unit` and so on; `make test-fast` is the unit tier (about a minute on 2 cores, README).
TIERS := unit exactness kernels server integration
.PHONY: $(addprefix test-,$(TIERS))
$(addprefix test-,$(TIERS)): test-%: install-dev
	$(BIN)/python -m pytest tests -m $* $(XDIST)

test-fast: test-unit

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
