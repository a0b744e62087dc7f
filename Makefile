# Two commands for a new machine:
#   make run    install jaxmoe into .venv and run the demo (python -m jaxmoe.demo)
#   make test   install jaxmoe with the test and PyTorch-bridge extras into .venv, run the tests
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test clean

$(PY):
	@PY=$$(tools/find_python.sh) && echo "using $$PY" && "$$PY" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test,bridge]"
	@touch $@

run: $(VENV)/.installed-run
	$(PY) -m jaxmoe.demo $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
