# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast lint bench docs clean

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
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# Everything: <= 10 minutes on 2 cores.
test: $(STAMP)
	$(PYTEST)

# The unit tier only (no process starts): <= 90 s on 2 cores.
test-fast: $(STAMP)
	$(PYTEST) -m unit tests/unit

# Linter, type checker and the layering contracts (pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports

# Side-by-side measurements (peers installed from the bench extra); writes benchmarks/results/.
bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/run.py

# Regenerate docs/config.md and docs/cli.md from the code (tests/processes/test_docgen.py fails when stale).
docs: $(STAMP)
	$(BIN)/python -m cadence.cli.docgen

clean:
	rm -rf $(VENV) runs build dist src/*.egg-info
