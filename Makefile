VENV := .venv

.PHONY: serve test test-all test-gpu
serve: $(VENV)/.installed
	$(VENV)/bin/goodserve serve

# The tiers (docs/testing.md): `make test` runs the fast one, everything but tests/e2e (whose
# subject is a process of its own) and the few tests marked slow; `make test-all` (CI) runs all. One thread per process: a
# test may run a server beside its client. One pytest worker a core (pytest-xdist), at most 4; a
# file's tests on one worker, so a module's server or engine starts once.
PYTEST := OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -n auto --maxprocesses 4 --dist loadfile
FAST_TIER := tests/unit tests/kernels tests/engine tests/server

test: $(VENV)/.installed
	$(PYTEST) -m "not slow" $(FAST_TIER)

test-all: $(VENV)/.installed
	$(PYTEST) tests

# The GPU regression gate (docs/testing.md): tests/gpu on CUDA, a JSON summary in $$GOODSERVE_GATE_OUT.
# On the lent GPU machine it runs through scripts/gpu_gate.sh (prepare, part1, run) instead.
test-gpu:
	PYTHON=$$([ -x $(VENV)/bin/python ] && echo $(VENV)/bin/python || echo python3) bash scripts/gpu_gate.sh suite

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
