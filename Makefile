# Two entry points: `make demo` (train the small preset on CPU, print its memory table) and
# `make test` (unit + parity suites). Each creates .venv and installs the pinned versions from
# constraints.txt once, with the torch extra (the parity suite compares with PyTorch), the
# gpu-plan extra (tests compile for H100/A100 targets without a GPU) and the hf extra; the stamp
# file makes a second run skip the install. `make check-jax-only` installs jaxmem alone (no
# PyTorch) into a fresh venv and trains, as a JAX user would.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast parity lint clean check-jax-only

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (or run: make PYTHON=python3 ...)"; exit 2; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[torch,dev,gpu-plan,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxmem train --preset small --policy selective --steps 200 --batch-size 16 --seq-len 128 --eval-every 50 --checkpoint-every 100 --out runs/demo-$$(date +%Y%m%d-%H%M%S)

# The suite on TEST_WORKERS processes (pytest-xdist), one file per worker at a time: a file's
# module-scoped fixtures (compiled models, trained runs) are built once, on one worker.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The inner loop (under 3 minutes on 2 cores): every module's quick tests, without those marked
# slow, multiprocess or gpu (pyproject.toml lists the markers). `make test` runs everything and is
# what CI runs.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not multiprocess and not gpu"

parity: $(STAMP)
	$(BIN)/jaxmem parity --preset tiny

# A fresh venv with `pip install .` only: the package imports and trains without PyTorch.
JAX_ONLY := $(or $(TMPDIR),/tmp)/jaxmem-jax-only
check-jax-only:
	rm -rf $(JAX_ONLY) && $(PYTHON) -m venv $(JAX_ONLY)
	$(JAX_ONLY)/bin/python -m pip install --quiet -c constraints.txt .
	cd $(JAX_ONLY) && bin/python -c "import importlib.util, sys; import jaxmem, jaxmem.train, jaxmem.train.run; \
	  assert importlib.util.find_spec('torch') is None, 'torch got installed'; \
	  assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_ref')]; print('jaxmem imports without torch')"
	cd $(JAX_ONLY) && bin/jaxmem train --preset tiny --steps 5 --batch-size 4 --seq-len 32 --sample-tokens 0 --out run
	cd $(JAX_ONLY) && ! bin/jaxmem parity 2> err.txt && grep -q "pip install 'jaxmem\[torch\]'" err.txt && cat err.txt
	rm -rf $(JAX_ONLY) build

lint: $(STAMP)
	$(BIN)/ruff check jaxmem torch_ref tests parity_tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
