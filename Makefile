# Two commands set up everything on a fresh Debian/Ubuntu machine:
#   make demo   run the example order workflow on ./demo.db and render its diagram
#   make test   lint, type-check and run the whole test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint system browser venv bench clean

system:
	@command -v dot >/dev/null 2>&1 || { \
	  echo "installing graphviz (the dot program) ..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq graphviz >/dev/null; }

# The dashboard's browser tests drive Debian's chromium (make test only; make demo needs no browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (the dashboard's browser tests) ..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }

$(BIN)/flowloop: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

venv: $(BIN)/flowloop

demo: system venv
	rm -f demo.db demo.db-wal demo.db-shm
	$(BIN)/flowloop run workflows/order.py --db demo.db \
	  --context '{"order_id": "A1", "items": [{"sku": "book", "qty": 2}, {"sku": "pen", "qty": 3}]}'
	$(BIN)/flowloop status --db demo.db
	$(BIN)/flowloop diagram workflows/order.py --format svg -o diagrams/order.svg
	@echo "diagram: diagrams/order.svg"
	@echo "the flowloop command is in $(BIN): export PATH=\"$$PWD/$(BIN):\$$PATH\" (or: . $(BIN)/activate)"

lint: venv
	$(BIN)/ruff check flowloop flowloop_pytest.py tests bench workflows
	$(BIN)/ruff format --check flowloop flowloop_pytest.py tests bench workflows
	$(BIN)/mypy

# Compiled once up front: where PYTHONDONTWRITEBYTECODE is set nothing writes __pycache__,
# and each of the suite's many flowloop processes would compile the sources again.
test: system browser venv lint
	$(BIN)/python -m compileall -q flowloop flowloop_pytest.py tests workflows
	$(BIN)/python -m pytest tests -q

bench: system venv
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/seq_steps.py

clean:
	rm -rf $(VENV) demo.db demo.db-wal demo.db-shm .pytest_cache .mypy_cache .ruff_cache
