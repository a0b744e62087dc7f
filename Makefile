# Two commands for a new machine:
#   make run    install jaxmoe into .venv, train the tiny MoE language model on CPU (python -m
#               jaxmoe.train --preset cpu_tiny) into a new runs/ directory, then generate from it
#   make test   install jaxmoe with the test and PyTorch-bridge extras into .venv, lint (ruff),
#               run the tests (two workers)
#   make test-quick   lint and the tests that do not interpret Pallas kernels (the inner loop)
#   make test-all   lint and every CPU test, the `exhaustive` ones too (run it when a kernel or
#                   the layer changes; `make test` leaves them out to stay within CI's time)
# On a machine with an NVIDIA Hopper GPU (H100/H200):
#   make test-gpu   the GPU test suite (pytest -m gpu, real layer sizes); writes its record to
#                   benchmarks/results/gpu_suite_<date>.json
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test test-quick test-all lint test-gpu clean

$(PY):
	@PY=$$(tools/find_python.sh) && echo "using $$PY" && "$$PY" -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test,bridge]"
	@touch $@

$(VENV)/.installed-gpu: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test,bridge,cuda]"
	@touch $@

# A new run directory each time: a run never writes over an earlier one.
run: $(VENV)/.installed-run
	@out=runs/cpu_tiny_$$(date +%Y%m%d_%H%M%S) && \
	$(PY) -m jaxmoe.train --preset cpu_tiny --out $$out $(ARGS) && \
	$(PY) -m jaxmoe.generate --checkpoint $$out --prompt "def main(" --max-new-tokens 160 --temperature 0.8 --top-p 0.95

lint: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two pytest workers (the CI machine has 2 cores; about half the time of one). GPU memory is not
# preallocated, so that on a GPU machine the two processes can share the device.
test: lint
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -n 2 -m "not exhaustive" $(ARGS)

test-all: lint
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -q -n 2 $(ARGS)

test-quick: lint
	$(PY) -m pytest -q -m "not slow" $(ARGS)

test-gpu: $(VENV)/.installed-gpu
	$(PY) -m pytest -q -m gpu --results-json benchmarks/results/gpu_suite_$$(date +%F).json $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
