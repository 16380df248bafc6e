VENV := .venv

.PHONY: serve test test-gpu
serve: $(VENV)/.installed
	$(VENV)/bin/goodserve serve

# One thread per process: the tests run a server and a client process side by side. One pytest
# worker a core (pytest-xdist), at most 4: on CI's 2 cores 13.5 minutes instead of 19.
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -n auto --maxprocesses 4

# The GPU regression gate (docs/testing.md): tests/gpu on CUDA, a JSON summary in $$GOODSERVE_GATE_OUT.
# On the lent GPU machine it runs through scripts/gpu_gate.sh (prepare, part1, run) instead.
test-gpu:
	PYTHON=$$([ -x $(VENV)/bin/python ] && echo $(VENV)/bin/python || echo python3) bash scripts/gpu_gate.sh suite

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
