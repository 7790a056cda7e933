# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_OUT := build/stdlib-moe
LINTED := moestream tests examples scripts

.PHONY: install test test-all test-ui demo bench lint format clean

NATIVE := setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/*.cuh csrc/*.h csrc/CMakeLists.txt)
PIP := $(BIN)/pip install --quiet --disable-pip-version-check

# The native engine is compiled against the venv's own MLX (no build isolation).
$(STAMP): pyproject.toml $(NATIVE)
	$(PYTHON) -m venv $(VENV)
	$(PIP) "setuptools>=77" "nanobind==3.1.0" "cmake>=3.25" "mlx[cpu]>=0.32.2,<0.33"
	$(PIP) --no-build-isolation -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# ruff, then the import contracts in pyproject.toml (docs/architecture.md).
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

# Test processes side by side (pytest-xdist), each test file in one of them so
# that module fixtures are built once; TEST_WORKERS=0 runs them in this one.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)

test: lint
	$(BIN)/pytest -q $(XDIST)

test-all: lint
	$(BIN)/pytest -q -m "" $(XDIST)

# The page's tests in a real browser: Chromium from apt-get (as root) and
# Playwright from PyPI if missing (it drives the system's Chromium). The page's
# screenshot goes to build/; docs/serve-page.png is replaced by hand, on purpose.
test-ui: $(STAMP)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq \
		&& apt-get install -y -qq chromium; } || { echo "test-ui: no chromium; \
		as root: apt-get install chromium"; exit 1; }
	@$(BIN)/python -c "import playwright" 2>/dev/null || $(PIP) "playwright>=1.40,<2"
	@mkdir -p build
	$(BIN)/pytest -q -p no:xdist -m ui tests/test_web.py --screenshot build/serve-page.png

demo: $(STAMP)
	$(BIN)/convert-moe examples/stdlib-moe $(DEMO_OUT) --force
	$(BIN)/run-moe $(DEMO_OUT) --prompt "def read_config(path):" \
		--max-tokens 120 --temp 0.7 --top-p 0.95 --seed 1 \
		--cache-experts 4 --stats

# The issue's comparison model (~1 GB), written once; then the table of ratios.
BENCH_OUT := build/bench-small
$(BENCH_OUT)/manifest.json: | $(STAMP)
	$(BIN)/moestream bench make-model small $(BENCH_OUT)

bench: $(STAMP) $(BENCH_OUT)/manifest.json
	$(BIN)/moestream bench $(BENCH_OUT)

clean:
	rm -rf build $(VENV) .pytest_cache .ruff_cache
