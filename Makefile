# sdbench: `make run` installs everything and runs the default benchmark; `make test` installs and tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sdbench-installed
ARGS ?=

.PHONY: setup run test bench peers qwen clean

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
