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
# 1024-wide models, the whole mutant set): minutes on two cores.
test: lint typecheck
	$(PY) -m pytest -q -m "not slow"

# Everything, including the slow accuracy and whole-fixture sweeps.
test-all: install
	HLO_SHARD_ALL_FIXTURES=1 $(PY) -m pytest -q

# ruff (rules in pyproject.toml); part of `make test`.
lint: install
	$(PY) -m ruff check .

# mypy on the modules that are clean so far (add a module once it is).
TYPED := hlo_shard/opinfo.py hlo_shard/graph.py hlo_shard/ir.py hlo_shard/validate.py \
	hlo_shard/passes/base.py hlo_shard/passes/retarget.py \
	hlo_shard/passes/pipeline.py hlo_shard/passes/registry.py \
	hlo_shard/passes/weight_update_sharding.py hlo_shard/passes/tuple_forwarding.py \
	hlo_shard/passes/channel_dedupe.py hlo_shard/passes/entry_layout.py \
	hlo_shard/passes/sharding_pipeline.py hlo_shard/passes/speed_gate.py \
	hlo_shard/passes/optimize.py hlo_shard/cli/optimize.py hlo_shard/jax/_api.py \
	hlo_shard/passes/replica_form.py hlo_shard/runtime/forms.py \
	hlo_shard/outputs.py hlo_shard/limits.py hlo_shard/schema.py hlo_shard/source.py \
	hlo_shard/profiles/__init__.py hlo_shard/cli/app.py \
	hlo_shard/printer.py hlo_shard/values.py hlo_shard/attributes.py \
	hlo_shard/analysis/replication.py hlo_shard/analysis/collectives.py \
	hlo_shard/runtime/verification.py hlo_shard/runtime/inputs.py hlo_shard/runtime/compare.py \
	hlo_shard/runtime/distributed.py hlo_shard/runtime/worker.py hlo_shard/runtime/_child.py \
	hlo_shard/runtime/executable.py hlo_shard/fuzz/*.py \
	hlo_shard/cli/verify.py hlo_shard/cli/fmt.py hlo_shard/cli/scale.py \
	hlo_shard/jax/_step.py hlo_shard/jax/_distributed.py hlo_shard/jax/hook.py \
	hlo_shard/jax/_api.py hlo_shard/jax/_capture.py hlo_shard/jax/_xla.py \
	hlo_shard/jax/__init__.py hlo_shard/jax/__main__.py hlo_shard/errors.py \
	hlo_shard/runtime/__init__.py hlo_shard/runtime/_lifeline.py hlo_shard/runtime/_launched.py \
	hlo_shard/runtime/_distributed_child.py \
	hlo_shard/costmodel hlo_shard/reports hlo_shard/scaling.py hlo_shard/analysis/planned_regions.py \
	hlo_shard/cli/report.py hlo_shard/cli/diff.py hlo_shard/cli/scale.py hlo_shard/passes/speed_gate.py \
	hlo_shard/parser.py hlo_shard/analysis/update_region.py \
	hlo_shard/passes/region_rewrite.py hlo_shard/passes/shard_emitter.py
TYPED += hlo_shard/analysis/names.py
TYPED += bench/jax_models_bench.py
typecheck: install
	$(PY) -m mypy --follow-imports=silent $(sort $(TYPED))

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
