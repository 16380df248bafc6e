VENV := .venv

.PHONY: serve test
serve: $(VENV)/.installed
	$(VENV)/bin/goodserve serve

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
