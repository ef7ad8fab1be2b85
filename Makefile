# Two entry points: `make demo` (train the small preset on CPU, print its memory table) and
# `make test` (unit + parity suites). Each creates .venv and installs the pinned versions from
# constraints.txt once; the stamp file makes a second run skip the install.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test parity lint clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (or run: make PYTHON=python3 ...)"; exit 2; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxmem train --preset small --policy selective --steps 200 --batch-size 16 --seq-len 128 --eval-every 50 --checkpoint-every 100 --out runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(BIN)/python -m pytest -q

parity: $(STAMP)
	$(BIN)/jaxmem parity --preset tiny

lint: $(STAMP)
	$(BIN)/ruff check jaxmem torch_ref tests parity_tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
