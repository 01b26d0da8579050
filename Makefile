# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast test-gpu lint bench bench-gpu docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: a CPU build is installed, and `torch>=2.4` is then already satisfied,
	# so the resolver never pulls several GB of CUDA wheels.
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf runs/digits
	# The trainer and a sidecar evaluator, two processes on one model dir.
	$(BIN)/cadence launch examples/digits/config.yaml --sidecar --model-dir runs/digits
	$(BIN)/cadence ls runs/digits
	@echo "Results in runs/digits: checkpoints/, best/, export/best/, train/, eval/ (evaluations.jsonl)."
	@echo "TensorBoard: $(BIN)/tensorboard --logdir runs/digits"

# The suite in tiers (tests/conftest.py marks each test by its folder): tests/unit/ starts no process,
# tests/processes/ starts cadence runs, torchrun jobs and servers, tests/gpu/ needs CUDA (skipped without).
# TEST_WORKERS pytest-xdist workers; --dist loadscope keeps a module (and its module-scoped fixtures) on one.
# 3 on 2 cores: the process tier's tests wait on their processes (ranks, servers, polls, kills), and a third
# worker fills those waits (the whole suite measured 10:30 with 2 workers and 9:42 with 3, on this 2-core machine).
# The unit tier computes in-process: FAST_WORKERS, one per core (44 s with 2, 65 s with 3).
TEST_WORKERS ?= 3
FAST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q --dist loadscope

# Everything: <= 10 minutes on 2 cores; the 25 slowest tests listed at the end (where the time goes).
test: $(STAMP)
	$(PYTEST) -n $(TEST_WORKERS) --durations=25

# The unit tier only (no process starts): <= 90 s on 2 cores.
test-fast: $(STAMP)
	$(PYTEST) -n $(FAST_WORKERS) -m unit tests/unit

# The CUDA paths (tests/gpu): pinned staging, NCCL with the gloo checkpoint group, bf16 / fp16,
# inductor, peak memory, MFU. Needs a CUDA build of torch; without CUDA every test is skipped (one reason).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

# Linter, type checker and the layering contracts (pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports

# Side-by-side measurements (peers installed from the bench extra); writes benchmarks/results/.
bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.run

# On a machine with CUDA (and transformers): the stall of a GPT-2-small-sized state's asynchronous save, then
# cadence's loop on GPT-2 small (bf16, eager and compiled) against a hand-written one; then the docs' tables.
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/checkpoint/stall_cuda.py --out benchmarks/results/checkpoint_stall_cuda.md
	$(BIN)/python benchmarks/loop/gpu_loop.py --out benchmarks/results/gpu_loop.md
	$(BIN)/python benchmarks/docs_tables.py

$(VENV)/.docs-installed: $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e ".[docs]"
	touch $@

# Regenerate docs/config.md and docs/cli.md from the code (tests/processes/test_docgen.py fails when stale), then build
# the site into site/ with --strict: a broken link, anchor or API reference fails (CI runs it after lint).
docs: $(VENV)/.docs-installed
	$(BIN)/python -m cadence.cli.docgen
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs build dist site src/*.egg-info
