"""The opcode table (``hlo_shard/opinfo.py``) against every opcode set the modules keep
today. A row says how the module's set is derived from the table and lists each place it
differs, with why; a module that derives its set from the table no longer defines it and
its row is skipped (delete the row then). The policy sets (which ops a fusion takes, which
a value flows through) stay with their modules; they are only checked for names that
are not HLO opcodes at all.
"""

from __future__ import annotations

import importlib

import pytest

from hlo_shard import opinfo
from hlo_shard.opinfo import OPINFO, opcodes_where

#: (module, attribute, derived from the table, {opcode: why it differs}).
#: A ``+`` opcode is in the table's set but not the module's, ``-`` the other way round.
FACT_SETS = [
    ("hlo_shard.parser", "OPCODES", opinfo.OPCODES, {}),
    ("hlo_shard.parser", "_UNARY", opcodes_where(lambda i: i.arity == (1, 1)),
     {"+while": "one operand; the parser lists its count apart"}),
    ("hlo_shard.parser", "_BINARY", opcodes_where(lambda i: i.arity == (2, 2)),
     {"+gather": "two operands; the parser lists its count apart"}),
    # The parser's two "elementwise" lists only build its arity table.
    ("hlo_shard.parser", "_UNARY_ELEMENTWISE",
     opcodes_where(lambda i: i.elementwise and i.arity == (1, 1)), {
         "+convert": "elementwise in XLA; the parser lists it with the other unary ops",
         "+imag": "idem", "+real": "idem"}),
    ("hlo_shard.parser", "_BINARY_ELEMENTWISE",
     opcodes_where(lambda i: i.elementwise and i.arity == (2, 2)), {
         "+compare": "elementwise in XLA; the parser lists it with the other binary ops",
         "+complex": "idem", "+stochastic-convert": "idem"}),
    ("hlo_shard.analysis.opcodes", "ELEMENTWISE", opinfo.ELEMENTWISE, {
        "+mulhi": "elementwise (XLA's IsOpElementwise); jax never emits it, so the region "
                  "analysis never met it",
        "+stochastic-convert": "elementwise (operand and random bits element by element)",
        "+map": "elementwise in XLA (its computation applied per element); the region "
                "analysis has no rule to re-emit a map on shards yet",
    }),
    ("hlo_shard.analysis.opcodes", "DETERMINISTIC",
     opcodes_where(lambda i: i.values == opinfo.DETERMINISTIC),
     {"+mulhi": "a pure function of its operands, missing from the module's list"}),
    ("hlo_shard.analysis.opcodes", "DEVICE_DEPENDENT",
     opcodes_where(lambda i: i.values == opinfo.PER_DEVICE), {}),
    ("hlo_shard.passes.region_rewrite", "_KEEP", opinfo.IMPURE | {"parameter"}, {
        # RegionRewrite._erase_dead keeps fewer ops than Rewriter.remove_dead: the rewrite
        # never makes these dead today, but a dead -start without its -done is invalid.
        "+all-reduce-start": "async: erasing one half leaves the other unmatched",
        "+all-reduce-done": "idem", "+all-gather-start": "idem", "+all-gather-done": "idem",
        "+collective-permute-start": "idem", "+collective-permute-done": "idem",
        "+async-start": "idem", "+async-update": "idem", "+async-done": "idem",
        "+copy-start": "idem", "+copy-done": "idem",
        "+add-dependency": "orders execution: its value is not why it is there",
        "+opt-barrier": "a scheduling barrier XLA keeps by design",
    }),
]

#: Sets that ``hlo_shard`` modules replaced by the table in this change, as they were;
#: kept so the replacement is checked against what it replaced.
REPLACED = [
    ("graph._SIDE_EFFECTING", opinfo.IMPURE | {"parameter"}, frozenset({
        "parameter", "send", "send-done", "recv", "recv-done", "outfeed", "infeed",
        "custom-call", "after-all", "rng", "rng-get-and-update-state", "all-reduce-start",
        "all-gather-start", "collective-permute-start", "async-start", "copy-start",
        "add-dependency", "opt-barrier"}), {
        "+all-reduce-done": "the -done of a kept -start must stay (a start without its done "
                            "is invalid HLO)",
        "+all-gather-done": "idem", "+collective-permute-done": "idem",
        "+async-update": "idem", "+async-done": "idem", "+copy-done": "idem"}),
    ("validate._CHANNEL_UNIQUE", opinfo.CHANNEL_UNIQUE, frozenset({
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
        "all-reduce-start", "all-gather-start", "collective-permute-start",
        "ragged-all-to-all", "collective-broadcast"}), {}),
    # validate's elementwise shape rule (operand dims = result dims) read
    # analysis.opcodes.ELEMENTWISE (see its row above for the three opcodes added).
    ("collective_model.COLLECTIVE_DONE_OPCODES", opinfo.COLLECTIVE_DONE,
     frozenset({"all-reduce-done", "all-gather-done", "collective-permute-done"}), {}),
    ("runtime.forms.PAIRED_CHANNEL_OPS", opinfo.CHANNEL_PAIRED,
     frozenset({"send", "recv", "send-done", "recv-done"}), {}),
    # The cost model's sets (analysis/cost.py, now costmodel/flops.py reads the table's
    # ``cost`` class).
    ("cost.TRANSCENDENTAL_OPCODES", opcodes_where(lambda i: i.transcendental), frozenset({
        "erf", "exponential", "log", "logistic", "power", "sqrt", "cbrt", "rsqrt", "tanh",
        "sine", "cosine", "exponential-minus-one", "log-plus-one", "atan2", "tan"}), {}),
    ("cost.ELEMENTWISE_OPCODES", opinfo.PER_ELEMENT_COST, frozenset({
        "erf", "exponential", "log", "logistic", "power", "sqrt", "cbrt", "rsqrt", "tanh",
        "sine", "cosine", "exponential-minus-one", "log-plus-one", "atan2", "tan",
        "abs", "add", "and", "atan", "acos", "acosh", "asin", "asinh", "atanh", "cosh", "sinh",
        "bitcast-convert", "ceil", "clamp", "compare", "complex", "convert",
        "count-leading-zeros", "divide", "floor", "imag", "is-finite", "maximum", "minimum",
        "mulhi", "multiply", "negate", "not", "or", "popcnt", "real", "reduce-precision",
        "remainder", "round-nearest-afz", "round-nearest-even", "select", "shift-left",
        "shift-right-arithmetic", "shift-right-logical", "sign", "stochastic-convert",
        "subtract", "xor"}), {}),
    ("cost.FREE_OPCODES", opinfo.NO_COST, frozenset({
        "parameter", "constant", "get-tuple-element", "domain", "bitcast", "after-all",
        "add-dependency"}), {}),
    ("cost.ALL_REDUCE_OPCODES", opcodes_where(lambda i: i.cost == opinfo.ALL_REDUCE),
     frozenset({"all-reduce", "all-reduce-start"}), {}),
]

#: Policy sets of the modules: only their names are checked. {opcode: what it should be}.
POLICY_SETS = [
    ("hlo_shard.costmodel.kernels", "FUSIBLE_OPCODES", {}),
    ("hlo_shard.costmodel.kernels", "POINTER_OPCODES", {}),
    ("hlo_shard.costmodel.kernels", "CONTROL_FLOW_OPCODES", {}),
    ("hlo_shard.costmodel.step_time", "UPDATE_OPCODES", {}),
    ("hlo_shard.costmodel.step_time", "FORMAT_OPCODES", {}),
    ("hlo_shard.costmodel.memory", "_IN_PLACE_OPCODES", {}),
    ("hlo_shard.analysis.replication", "_FLOW_THROUGH", {}),
    ("hlo_shard.analysis.update_region", "_PULLABLE", {}),
    ("hlo_shard.costmodel.kernels", "_KERNEL_ROOTS", {}),
    ("hlo_shard.costmodel.step_time", "_DEVICE_ID_OPCODES", {}),
    ("hlo_shard.costmodel.step_time", "_MATRIX_OPCODES", {}),
    ("hlo_shard.analysis.update_region", "_SCALAR_OK", {}),
    ("hlo_shard.analysis.opcodes", "_BODY_EXTRA", {}),
    # Rule tables keyed by opcode.
    ("hlo_shard.costmodel.flops", "RULES", {}),
    ("hlo_shard.analysis.update_region", "RULES", {}),
    ("hlo_shard.validate", "_SHAPE_RULES", {}),
    ("hlo_shard.attributes", "REQUIRED_ATTRIBUTES", {}),
    ("hlo_shard.attributes", "OPCODE_ATTRIBUTES", {}),
    # These held jax primitive names (exp, log1p, optimization-barrier …) once.
    ("hlo_shard.runtime.inputs", "PASS_THROUGH", {}),
    ("hlo_shard.runtime.inputs", "POSITIVE_OPERANDS", {}),
    ("hlo_shard.runtime.inputs", "POSITIVE_IF", {}),
]


def _module_set(module: str, attribute: str):
    holder = importlib.import_module(module)
    for part in attribute.split("."):
        if not hasattr(holder, part):
            pytest.skip(f"{module}.{attribute} is gone: switched to hlo_shard.opinfo "
                        "(delete this row)")
        holder = getattr(holder, part)
    return holder


def _differences(table: frozenset[str], current) -> set[str]:
    return {f"+{op}" for op in table - set(current)} | {f"-{op}" for op in set(current) - table}


@pytest.mark.parametrize("module, attribute, table, documented", FACT_SETS,
                         ids=[f"{m.rsplit('.', 1)[1]}.{a}" for m, a, _, _ in FACT_SETS])
def test_module_set_differs_from_the_table_only_where_documented(module, attribute, table,
                                                                 documented):
    assert _differences(table, _module_set(module, attribute)) == set(documented)


@pytest.mark.parametrize("name, table, old, documented", REPLACED,
                         ids=[name for name, *_ in REPLACED])
def test_replaced_set_differs_only_where_documented(name, table, old, documented):
    assert _differences(table, old) == set(documented)


def test_operand_counts_are_the_parsers():
    counts = _module_set("hlo_shard.parser", "_OPERAND_COUNTS")
    assert {n: i.arity for n, i in OPINFO.items() if i.arity is not None} == counts


def test_channel_ids_of_the_shard_emitter_are_the_validators():
    assert _module_set("hlo_shard.passes.shard_emitter", "ChannelIds.COLLECTIVES") \
        == opinfo.CHANNEL_UNIQUE


def test_collective_kinds_are_those_the_cost_model_had():
    """analysis/collective_model.py's table before it was derived from opinfo."""
    assert opinfo.COLLECTIVE_KINDS == {
        "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
        "reduce-scatter": "reduce-scatter",
        "all-gather": "all-gather", "all-gather-start": "all-gather",
        "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
        "collective-permute": "collective-permute",
        "collective-permute-start": "collective-permute",
        "collective-broadcast": "collective-broadcast",
    }


@pytest.mark.parametrize("module, attribute, misspelt", POLICY_SETS,
                         ids=[f"{m.rsplit('.', 1)[1]}.{a}" for m, a, _ in POLICY_SETS])
def test_policy_sets_name_real_opcodes(module, attribute, misspelt):
    names = set(_module_set(module, attribute))
    assert {n: None for n in names - opinfo.OPCODES} == dict.fromkeys(misspelt)
    assert set(misspelt.values()) <= opinfo.OPCODES


def test_xla_prices_some_ops_unlike_their_elementwise_fact():
    """The named exceptions :attr:`OpInfo.cost` exists for."""
    assert opinfo.ELEMENTWISE - opinfo.PER_ELEMENT_COST == {"copy", "map"}  # bytes / callee
    # Elementwise in XLA only when the bit widths agree; priced per element always.
    assert opinfo.PER_ELEMENT_COST - opinfo.ELEMENTWISE == {"bitcast-convert"}


def test_async_pairs_point_at_each_other():
    for name, info in OPINFO.items():
        if info.async_done is not None and not info.name.endswith("-update"):
            assert OPINFO[info.async_done].async_start == name
        if info.is_async_done:
            assert OPINFO[info.async_start].async_done == name
            assert info.impure == OPINFO[info.async_start].impure


def test_unknown_opcodes_are_kept_as_impure():
    assert opinfo.is_impure("reduce-scatter-start") and opinfo.is_impure("send")
    assert not opinfo.is_impure("add") and not opinfo.is_impure("all-reduce")
