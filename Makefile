# Two commands for a new machine:
#   make run    install into .venv and run the demo (python -m jaxmoe.demo)
#   make test   install into .venv and run the test suite
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml
	@PY=$$(tools/find_python.sh) && echo "using $$PY" && "$$PY" -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m jaxmoe.demo $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
