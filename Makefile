VENV := .venv

.PHONY: serve test
serve: $(VENV)/.installed
	$(VENV)/bin/goodserve serve

# One thread per process: the tests run a server and a client process side by side on 2 cores.
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
