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

.PHONY: demo test test-fast parity lint clean check-jax-only test-versions test-newest test-gpu-image \
	test-versions-python

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

# The other exact sets (constraints-newest.txt: the newest jax, flax and torch served;
# constraints-gpu-image.txt: the GPU image's jax 0.11.2 and torch 2.11), each in its own venv on
# Python 3.12 (jax >= 0.11 needs it), the fast suite on the CPU. torch for Python 3.12 comes as
# PyPI's CUDA build: about 7 GB per venv, downloaded once into pip's cache.
PYTHON312 ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
  $$p -c '' >/dev/null 2>&1 && { echo $$p; break; }; done)
.venv-%/.installed: pyproject.toml constraints-%.txt
	@$(or $(PYTHON312),false) -c 'import sys; assert sys.version_info[:2] >= (3, 12)' 2>/dev/null || { echo "need Python 3.12 for constraints-$*.txt (run: make PYTHON312=/path/to/python3.12 ...)"; exit 2; }
	test -x .venv-$*/bin/python || $(PYTHON312) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-$*/bin/python -m pip install --quiet -c constraints-$*.txt -e '.[torch,dev,gpu-plan,hf]'
	touch $@

test-newest: .venv-newest/.installed
	.venv-newest/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not multiprocess and not gpu"

test-gpu-image: .venv-gpu-image/.installed
	.venv-gpu-image/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not multiprocess and not gpu"

test-versions: test-newest test-gpu-image

# exits 0 where a Python 3.12 for the other sets is found (CI asks before running them)
test-versions-python:
	@$(or $(PYTHON312),false) -c 'import sys; assert sys.version_info[:2] >= (3, 12)'

lint: $(STAMP)
	$(BIN)/ruff check jaxmem torch_ref tests parity_tests benchmarks

clean:
	rm -rf $(VENV) .venv-newest .venv-gpu-image .pytest_cache *.egg-info
