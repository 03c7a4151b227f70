# kdtree-engine. `make demo` and `make test` are the README's two commands.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TINY    ?= artifacts/tiny-kimi
DRAFTER ?= artifacts/tiny-kimi-dflash
STAMP   := $(VENV)/.installed
# build artifacts (`kdtree build`, models built on the fly by tests) are cached under the workspace
export KDTREE_CACHE ?= $(CURDIR)/.cache/kdtree

.PHONY: setup test test-gpu test-gpu-quick demo demo-tiny bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

# on the GPU machine (system python there already has torch, triton, transformers): every GPU test file in its own
# process, side by side (tests/run_gpu_parallel.sh; one `pytest -q -m gpu` in series ran past 9 minutes, H100)
test-gpu:
	FILE_TIMEOUT_S=$${FILE_TIMEOUT_S:-570} bash tests/run_gpu_parallel.sh

# every GPU test file at once, a fifth of the random cases: a re-check that fits one device call
test-gpu-quick:
	KDTREE_GPU_QUICK=1 bash tests/run_gpu_parallel.sh

$(TINY)/config.json: | setup
	$(BIN)/kdtree make-tiny $(TINY) --preset kimi --int4 --kimi25 --force

$(DRAFTER)/config.json: $(TINY)/config.json
	$(BIN)/kdtree make-tiny $(DRAFTER) --drafter-for $(TINY) --force

# the bundled pair (artifacts/demo-pair: a small Kimi-K2-architecture target and its DFlash drafter, trained
# on CPython's standard library by scripts/train_demo.py) writes Python; the stats line shows tau and tokens/s
PAIR    ?= artifacts/demo-pair
DEMO_PROMPT ?= import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n

demo: setup
	$(BIN)/kdtree run $(PAIR)/target --drafter $(PAIR)/drafter --spec ddtree --budget 16 \
		--prompt "$$(printf '$(DEMO_PROMPT)')" --max-new-tokens 96

# the random tiny model in the exact Kimi K2.6 layout (kimi_k25 config, INT4 experts) and a random drafter
demo-tiny: setup $(TINY)/config.json $(DRAFTER)/config.json
	$(BIN)/kdtree run $(TINY) --drafter $(DRAFTER) --spec ddtree --budget 16 \
		--prompt "The quick brown fox" --max-new-tokens 48

bench: setup
	@echo "benchmarks run on the GPU machine: see benchmarks/README.md"

lint: setup
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check build_pipeline plugins runtime tests benchmarks

clean:
	rm -rf $(VENV) artifacts/tiny-* .cache
