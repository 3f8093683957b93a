# hlo-shard developer targets. `make install && make test` on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
N      ?= 8

.PHONY: install test test-all lint typecheck bench fixtures fuzz demo-distributed clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The CI suite: lint, the type check of the typed modules, and every test but those
# marked `slow` (one XLA compile per fixture for the cost model's accuracy, the
# 1024-wide models, the whole mutant set): minutes on two cores, in two workers
# (pytest-xdist), each test file in one of them so that its module fixtures run once;
# TEST_WORKERS=0 runs every test in this process.
test: lint typecheck
	$(PY) -m pytest -q -m "not slow" -n $${TEST_WORKERS:-2} --dist loadfile

# Everything, including the slow accuracy and whole-fixture sweeps.
test-all: install
	HLO_SHARD_ALL_FIXTURES=1 $(PY) -m pytest -q

# ruff (rules in pyproject.toml); part of `make test`.
lint: install
	$(PY) -m ruff check .

# mypy on the whole package (a new module is checked by default; settings in
# pyproject.toml) and the typed bench driver.
TYPED := hlo_shard bench/jax_models_bench.py
typecheck: install
	$(PY) -m mypy $(TYPED)

fixtures: install
	$(PY) scripts/make_fixtures.py --out fixtures

bench: install
	$(PY) bench/run.py

# Differential fuzzing: CASES random training steps from seed SEED, each optimized in
# VARIANTS of the 6 --state x --strategy variants (rotating, so all are covered) and
# verified on N = 2, 3, 4 or 8 CPU devices. The default, 2000 cases x 1 variant, took
# 45 min on two (shared) cores; all 6 variants per case take about 4x as long.
fuzz: install
	$(PY) -m hlo_shard.fuzz --cases $${CASES:-2000} --seed $${SEED:-0} \
	    --variants-per-case $${VARIANTS:-1}

# hlo-shard on 2 jax.distributed processes x 4 CPU devices on localhost: a training
# loop through hlo_shard.jax and `verify --processes 2` (docs/distributed.md).
demo-distributed: install
	$(PY) scripts/demo_distributed.py

clean:
	rm -rf $(VENV) build dist bench/out .pytest_cache
