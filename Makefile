# The two commands of the README: `make serve` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup serve test clean

setup: $(STAMP)

# torch first, pinned alone: pip then takes the local CPU wheel and never resolves a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

serve: setup
	$(BIN)/tritonspec serve

# Lint and format checks, then every test (`pytest -m unit`: the in-process ones only) on
# TEST_WORKERS pytest-xdist workers, a test module to a worker; the slowest 15 are listed at the
# end, then how long the whole of it took (README, Tests). Two workers where 12 GB are free
# to this process (host and cgroup; scripts/test_workers.py), else one process (0).
TEST_WORKERS ?= $(or $(shell $(PYTHON) scripts/test_workers.py 2>/dev/null),0)
test: setup
	@start=$$(date +%s); \
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && \
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile tests; \
	status=$$?; took=$$(( $$(date +%s) - start )); \
	echo "make test: $$((took / 60)) min $$((took % 60)) s (ruff and pytest)"; exit $$status

clean:
	rm -rf $(VENV)
