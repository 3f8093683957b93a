"""The opcode table (``hlo_shard/opinfo.py``) against every opcode set the modules keep
today. A row says how the module's set is derived from the table and lists each place it
differs, with why; a module that derives its set from the table no longer defines it and
its row is skipped (delete the row then). The sets modules still name (derived from the
table's fields, or rule tables keyed by opcode) are checked for names that are not HLO
opcodes at all, and a literal list of opcodes anywhere in the package is one of the
documented exceptions at the end.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from hlo_shard import opinfo
from hlo_shard.opinfo import OPINFO, opcodes_where

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
    # analysis.opcodes.ELEMENTWISE (see its row below for the three opcodes added).
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
    ("weight_update.emit.ChannelIds.COLLECTIVES", opinfo.CHANNEL_UNIQUE, frozenset({
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
        "collective-permute", "collective-broadcast", "all-reduce-start", "all-gather-start",
        "collective-permute-start"}), {}),
    # RegionRewrite._erase_dead kept fewer ops than Rewriter.remove_dead, which it uses now
    # (graph.is_impure: parameters and the table's impure ops).
    ("weight_update.lowering._KEEP", opinfo.IMPURE | {"parameter"}, frozenset({
        "parameter", "custom-call", "infeed", "outfeed", "send", "recv", "rng", "send-done",
        "recv-done", "after-all", "rng-get-and-update-state"}), {
        "+all-reduce-start": "async: erasing one half leaves the other unmatched",
        "+all-reduce-done": "idem", "+all-gather-start": "idem", "+all-gather-done": "idem",
        "+collective-permute-start": "idem", "+collective-permute-done": "idem",
        "+async-start": "idem", "+async-update": "idem", "+async-done": "idem",
        "+copy-start": "idem", "+copy-done": "idem",
        "+add-dependency": "orders execution: its value is not why it is there",
        "+opt-barrier": "a scheduling barrier XLA keeps by design"}),
    # The parser's arity lists built its operand counts (equal to the table's arity), its
    # two elementwise lists the rule that infers an omitted shape as the first operand's.
    ("parser._UNARY_ELEMENTWISE | _BINARY_ELEMENTWISE | {clamp}",
     opcodes_where(lambda i: i.shape_from != ""), frozenset("""abs acos acosh asin asinh atan
        atanh cbrt ceil copy cosh cosine count-leading-zeros erf exponential
        exponential-minus-one floor is-finite log log-plus-one logistic negate not popcnt
        reduce-precision round-nearest-afz round-nearest-even rsqrt sign sine sinh sqrt tan
        tanh add and atan2 divide maximum minimum mulhi multiply or power remainder
        shift-left shift-right-arithmetic shift-right-logical subtract xor clamp""".split()), {
        "+compare": "had a rule of its own (pred), now shape_from=PRED",
        "+select": "had a rule of its own (the second operand's), now shape_from=SECOND"}),
    # analysis/opcodes.py (deleted): the region analysis and the replication analysis
    # read these; both derive theirs from the table now.
    ("analysis.opcodes.ELEMENTWISE", opinfo.ELEMENTWISE, frozenset({
        "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cbrt", "ceil", "cosine",
        "cosh", "count-leading-zeros", "erf", "exponential", "exponential-minus-one", "floor",
        "imag", "is-finite", "log", "log-plus-one", "logistic", "negate", "not", "popcnt",
        "real", "reduce-precision", "round-nearest-afz", "round-nearest-even", "rsqrt", "sign",
        "sine", "sinh", "sqrt", "tan", "tanh", "convert", "copy", "add", "atan2", "complex",
        "divide", "maximum", "minimum", "multiply", "power", "remainder", "shift-left",
        "shift-right-arithmetic", "shift-right-logical", "subtract", "and", "or", "xor",
        "compare", "select", "clamp"}), {
        "+mulhi": "elementwise (XLA's IsOpElementwise); jax never emits it",
        "+stochastic-convert": "elementwise (operand and random bits element by element)",
        "+map": "elementwise in XLA; the region analysis leaves it out (weight_update.analysis."
                "_SHARDABLE: its dimensions= name the full value's)"}),
    ("analysis.opcodes.DETERMINISTIC", opcodes_where(lambda i: i.values == opinfo.DETERMINISTIC),
     frozenset({"abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cbrt", "ceil",
                "cosine", "cosh", "count-leading-zeros", "erf", "exponential",
                "exponential-minus-one", "floor", "imag", "is-finite", "log", "log-plus-one",
                "logistic", "negate", "not", "popcnt", "real", "reduce-precision",
                "round-nearest-afz", "round-nearest-even", "rsqrt", "sign", "sine", "sinh",
                "sqrt", "tan", "tanh", "convert", "copy", "add", "atan2", "complex", "divide",
                "maximum", "minimum", "multiply", "power", "remainder", "shift-left",
                "shift-right-arithmetic", "shift-right-logical", "subtract", "and", "or",
                "xor", "compare", "select", "clamp", "bitcast-convert", "stochastic-convert",
                "broadcast", "reshape", "bitcast", "transpose", "slice", "dynamic-slice",
                "dynamic-update-slice", "concatenate", "pad", "reverse", "iota", "constant",
                "dot", "convolution", "reduce", "reduce-window", "map", "sort", "gather",
                "scatter", "select-and-scatter", "cholesky", "triangular-solve", "fft",
                "get-dimension-size", "set-dimension-size", "dynamic-reshape", "topk",
                "batch-norm-training", "batch-norm-inference", "batch-norm-grad", "domain",
                "ragged-dot", "scaled-dot"}),
     {"+mulhi": "a pure function of its operands, missing from the module's list"}),
    ("analysis.opcodes.DEVICE_DEPENDENT", opcodes_where(lambda i: i.values == opinfo.PER_DEVICE),
     frozenset({"replica-id", "partition-id", "rng", "rng-bit-generator",
                "rng-get-and-update-state", "infeed", "recv", "recv-done", "custom-call",
                "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
                "collective-permute-start", "collective-permute-done",
                "collective-broadcast"}), {}),
]

# Sets that were literal lists beside the table and are now its fields (opinfo's derived
# sets); inline ones are named by where they were.
REPLACED += [
    ("costmodel.kernels.FUSIBLE_OPCODES", opinfo.FUSIBLE, opinfo.PER_ELEMENT_COST | frozenset({
        "broadcast", "reshape", "bitcast", "transpose", "copy", "iota", "constant", "slice",
        "dynamic-slice", "pad", "concatenate", "reverse", "reduce", "dynamic-update-slice"}),
     {}),
    ("costmodel.kernels._KERNEL_ROOTS", opinfo.KERNEL_ROOTS,
     frozenset({"reduce", "dynamic-update-slice"}), {}),
    ("costmodel.kernels.CONTROL_FLOW_OPCODES", opinfo.CONTROL_FLOW,
     frozenset({"while", "call", "conditional"}), {}),
    ("costmodel.memory._IN_PLACE_OPCODES", opinfo.IN_PLACE, opinfo.PER_ELEMENT_COST | frozenset(
        {"dynamic-update-slice", "while", "fusion"}), {}),
    ("costmodel.step_time.FORMAT_OPCODES", opinfo.FORMATTING, frozenset({
        "reshape", "bitcast", "transpose", "copy", "pad", "slice", "dynamic-slice",
        "concatenate"}), {}),
    ("costmodel.step_time._MATRIX_OPCODES (and kernels._absorbed_transpose, "
     "weight_update.emit's dot or convolution)", opinfo.MATMULS,
     frozenset({"dot", "convolution"}), {}),
    ("costmodel.step_time.formatting_ops' gathers", opinfo.ALL_GATHERS,
     frozenset({"all-gather", "all-gather-start"}), {}),
    ("costmodel.step_time._is_sum_collective", opinfo.SUMMING_COLLECTIVES,
     frozenset({"all-reduce", "reduce-scatter", "all-reduce-start"}), {}),
    ("costmodel.step_time: the views a gradient's users are followed through",
     opinfo.ORDER_KEEPING_VIEWS, frozenset({"bitcast", "reshape", "copy"}), {}),
    ("costmodel.kernels.is_relabel", opcodes_where(
        lambda i: i.moves in (opinfo.RESHAPE, opinfo.COPY)), frozenset({"reshape", "copy"}), {}),
    ("costmodel.kernels._read_size's slices", opcodes_where(lambda i: i.moves == opinfo.WINDOW),
     frozenset({"slice", "dynamic-slice"}), {}),
    ("analysis.collectives.DEVICE_ID_OPCODES", opinfo.DEVICE_IDS,
     frozenset({"partition-id", "replica-id"}), {}),
    ("analysis.collectives._GROUPED", opinfo.GROUPED, frozenset({
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "all-reduce-start",
        "all-gather-start", "collective-broadcast"}), {
        "+ragged-all-to-all": "has replica_groups= like all-to-all (attributes.py)"}),
    ("analysis.collectives.find_gradient_all_reduces", opinfo.ALL_REDUCES,
     frozenset({"all-reduce", "all-reduce-start"}), {}),
    ("analysis.collectives._LAYOUT_ONLY's views", opinfo.VIEWS,
     frozenset({"copy", "transpose", "bitcast", "reshape"}), {}),
    ("weight_update.analysis.VIEW_OPCODES", opinfo.SHAPE_VIEWS,
     frozenset({"transpose", "reshape", "bitcast"}), {}),
    ("weight_update.analysis._view_back (and _PULLABLE's views)", opinfo.LOGICAL_VIEWS,
     frozenset({"transpose", "reshape"}), {}),
    ("weight_update.analysis._SCALAR_OK (and validate._elementwise)", opinfo.SCALAR_OPERANDS,
     frozenset({"clamp", "select"}), {}),
    ("weight_update.lowering._PADDING_RULES: _all_zero", opinfo.ZERO_PRESERVING, frozenset({
        "add", "subtract", "maximum", "minimum", "negate", "abs", "sqrt", "sign", "convert",
        "and", "or", "tanh", "sine", "bitcast-convert"}), {}),
    ("weight_update.lowering._PADDING_RULES: _same", opinfo.VIEWS,
     frozenset({"copy", "reshape", "bitcast", "transpose"}), {}),
]

#: Policy sets of the modules: only their names are checked. {opcode: what it should be}.
POLICY_SETS = [
    ("hlo_shard.costmodel.kernels", "POINTER_OPCODES", {}),
    ("hlo_shard.analysis.collectives", "_LAYOUT_ONLY", {}),
    ("hlo_shard.analysis.collectives", "_INDEX_ARITHMETIC", {}),
    ("hlo_shard.passes.weight_update.analysis", "_SCALAR_BODY", {}),
    ("hlo_shard.analysis.replication", "_BODY_EXTRA", {}),
    # What the emitter wraps in a loop fusion of its own past XLA's fusion passes: a
    # choice about XLA:CPU's kernels, not a fact about the ops.
    ("hlo_shard.passes.weight_update.emit", "_FUSED_WHEN_LAID_OUT", {}),
    # Rule tables keyed by opcode.
    ("hlo_shard.costmodel.flops", "RULES", {}),
    ("hlo_shard.passes.weight_update.analysis", "RULES", {}),
    ("hlo_shard.validate", "_SHAPE_RULES", {}),
    ("hlo_shard.attributes", "REQUIRED_ATTRIBUTES", {}),
    ("hlo_shard.attributes", "OPCODE_ATTRIBUTES", {}),
    # Choices of the fuzzer and mutant generator (what they emit or mutate), and the
    # attribute table's own list (which ops take result_accuracy=).
    ("hlo_shard.fuzz.frontend", "_OPS_UNARY", {}),
    ("hlo_shard.fuzz.frontend", "_OPS_BINARY", {}),
    ("hlo_shard.attributes", "_UNARY_WITH_ACCURACY", {}),
    # The values a profile's ``combined_collectives`` may name (the kinds XLA has a
    # combiner pass for): the profile schema's choice list.
    ("hlo_shard.profiles", "COMBINABLE_COLLECTIVES", {}),
    # These held jax primitive names (exp, log1p, optimization-barrier …) once.
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


def _literal_strings(node: ast.expr) -> frozenset[str]:
    """The strings of a literal set/list/tuple, ``frozenset(...)`` of one, or of
    ``"a b c".split()``; empty for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in ("frozenset", "set") and len(node.args) == 1:
        return _literal_strings(node.args[0])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "split" and isinstance(node.func.value, ast.Constant) \
            and isinstance(node.func.value.value, str):
        return frozenset(node.func.value.value.split())
    if isinstance(node, (ast.Set, ast.List, ast.Tuple)) and node.elts and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return frozenset(e.value for e in node.elts)  # type: ignore[attr-defined]
    return frozenset()


def _opcode_lists(source: str) -> set[str]:
    """Names of the module-level literal sets of two or more opcode names in ``source``."""
    found = set()
    for node in ast.parse(source).body:
        target = (node.targets[0] if isinstance(node, ast.Assign) else
                  node.target if isinstance(node, ast.AnnAssign) else None)
        if not isinstance(target, ast.Name) or node.value is None:
            continue
        names = _literal_strings(node.value)
        if len(names) >= 2 and names <= opinfo.OPCODES:
            found.add(target.id)
    return found


def _package_sources() -> list[tuple[str, str]]:
    """(module, source) of every module of the package, opinfo itself aside."""
    root = Path(opinfo.__file__).parent
    sources = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(("hlo_shard", *(parts[:-1] if parts[-1] == "__init__" else parts)))
        if module != "hlo_shard.opinfo":
            sources.append((module, path.read_text()))
    return sources


def _literal_opcode_sets() -> set[tuple[str, str]]:
    """(module, name) of every module-level literal opcode set in the package, opinfo
    itself aside."""
    return {(module, name) for module, source in _package_sources()
            for name in _opcode_lists(source)}


def test_opcode_facts_come_from_the_table():
    """A module keeping its own list of opcodes is either a policy (listed below, names
    checked) or a fact that belongs in ``OPINFO``: a new literal list fails here."""
    policies = {(module, attribute) for module, attribute, _ in POLICY_SETS}
    assert _literal_opcode_sets() - policies == set()


def test_the_literal_set_finder_finds_a_literal_set():
    assert _opcode_lists('A = frozenset({"add", "multiply"})\nB = frozenset("add copy".split())\n'
                         'C = {"add"}\nD = ("add", "not-an-opcode")') == {"A", "B"}


@pytest.mark.parametrize("name, table, old, documented", REPLACED,
                         ids=[name for name, *_ in REPLACED])
def test_replaced_set_differs_only_where_documented(name, table, old, documented):
    assert _differences(table, old) == set(documented)


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


# ------------------------------------------------------------- facts as fields, not lists

REPLACED_INLINE = [
    ("analysis.replication: replicated over the group", opinfo.REPLICATING_COLLECTIVES,
     frozenset({"all-reduce", "all-gather", "all-reduce-start", "all-gather-start"}), {}),
    ("analysis.replication: the value of operand 0", opinfo.FORWARDING,
     frozenset({"opt-barrier", "add-dependency"}), {}),
    ("analysis.replication: the callee's value", opinfo.CALLS_ONCE,
     frozenset({"call", "fusion", "async-start"}), {}),
    ("runtime.inputs.demanded_parameters: callees", opcodes_where(
        lambda i: i.calls in (opinfo.CALL, opinfo.KERNEL)), frozenset({"fusion", "call"}), {}),
    ("reduce_scatter_creation._INDEX_RULES: row-major values as they are",
     opinfo.ORDER_KEEPING_VIEWS | {"convert"},
     frozenset({"reshape", "copy", "convert", "bitcast"}), {}),
    ("analysis.replication: a -done's value is its start's", frozenset(
        name for name in opinfo.with_async_forms(opinfo.REPLICATING_COLLECTIVES | opinfo.VIEWS)
        if OPINFO[name].is_async_done),
     frozenset({"all-reduce-done", "all-gather-done", "copy-done"}), {}),
    ("analysis.replication._FLOW_THROUGH", opinfo.PER_ELEMENT | opinfo.DATA_MOVEMENT,
     opinfo.ELEMENTWISE | frozenset({
         "broadcast", "reshape", "bitcast", "transpose", "slice", "concatenate", "pad",
         "bitcast-convert", "dynamic-slice", "dynamic-update-slice"}),
     {"+reverse": "moves elements as transpose does; outputs identical (249 of 249)"}),
    ("runtime.inputs.PASS_THROUGH", opinfo.with_async_forms(
        opinfo.PER_ELEMENT | opinfo.DATA_MOVEMENT | opinfo.ALL_GATHERS),
     opinfo.ELEMENTWISE | frozenset({
         "bitcast", "bitcast-convert", "broadcast", "concatenate", "copy-done", "copy-start",
         "dynamic-slice", "dynamic-update-slice", "pad", "reshape", "reverse", "slice",
         "transpose", "all-gather", "all-gather-start", "all-gather-done"}), {}),
    ("costmodel.step_time.UPDATE_OPCODES", opinfo.PER_ELEMENT_COST | opinfo.FORMATTING
     | opcodes_where(lambda i: i.moves == opinfo.BROADCAST) | {"reduce", "get-tuple-element"},
     opinfo.PER_ELEMENT_COST | frozenset({
         "broadcast", "reshape", "bitcast", "transpose", "copy", "reduce", "slice",
         "dynamic-slice", "concatenate", "pad", "get-tuple-element"}), {}),
    ("costmodel.step_time.formatting_ops: after an all-gather", opinfo.FORMATTING
     | (opinfo.with_async_forms(opinfo.ALL_GATHERS) & opinfo.COLLECTIVE_DONE)
     | {"get-tuple-element"}, opinfo.FORMATTING | {"get-tuple-element", "all-gather-done"},
     {}),
    ("weight_update.analysis._PULLABLE", (opinfo.ELEMENTWISE - {"map"})
     | opinfo.PER_ELEMENT_COST | opinfo.LOGICAL_VIEWS,
     (opinfo.ELEMENTWISE - {"map"}) | {"transpose", "reshape", "bitcast-convert"}, {}),
    ("fuzz.mutants.GRADIENT_COLLECTIVES", opinfo.SUMMING_COLLECTIVES,
     frozenset({"reduce-scatter", "all-reduce", "all-reduce-start"}), {}),
    ("fuzz.mutants.NON_COMMUTATIVE", opinfo.NON_COMMUTATIVE, frozenset({
        "subtract", "divide", "power", "atan2", "remainder", "compare", "shift-left",
        "shift-right-arithmetic", "shift-right-logical"}), {
        "+complex": "complex(re, im): swapping its operands changes the value",
        "+stochastic-convert": "its operands are a value and random bits"}),
]


@pytest.mark.parametrize("name, table, old, documented", REPLACED_INLINE,
                         ids=[name for name, *_ in REPLACED_INLINE])
def test_replaced_inline_set_differs_only_where_documented(name, table, old, documented):
    assert _differences(table, old) == set(documented)


#: Literal sets of two or more opcode names that stay in the package, by module and
#: names, with why: none of them is a fact of an opcode that some other module needs.
LITERAL_SETS_ALLOWED: dict[tuple[str, frozenset[str]], str] = {
    # Matchers of one form XLA emits, opcode by opcode as XLA writes it.
    ("hlo_shard.analysis.collectives", frozenset({
        "add", "bitcast", "broadcast", "clamp", "compare", "convert", "copy", "divide",
        "dynamic-slice", "maximum", "minimum", "multiply", "remainder", "reshape", "select",
        "slice", "subtract"})): "the SPMD partitioner's offset arithmetic (_INDEX_ARITHMETIC)",
    ("hlo_shard.analysis.collectives", frozenset({"convert", "get-tuple-element"})):
        "what the partitioner writes between an all-reduce and its slice besides views",
    ("hlo_shard.analysis.collectives", frozenset({"dynamic-update-slice", "parameter",
                                                  "while"})):
        "the partitioner's reduce-scatter form across a scan: a loop's tuple, a body's "
        "tuple parameter and the update writing a layer's sum into its carried slot",
    # A computation's leaves and tuple plumbing: the structure, not a fact of the ops.
    ("hlo_shard.analysis.replication", frozenset({"broadcast", "constant", "parameter"})):
        "an elementwise fusion body's leaves: parameters, scalar constants, their broadcasts",
    ("hlo_shard.passes.weight_update.analysis", frozenset({"constant", "parameter"})):
        "a scalar body's leaves",
    ("hlo_shard.costmodel.step_time", frozenset({"get-tuple-element", "tuple"})):
        "tuple plumbing a gradient's users are followed through",
    ("hlo_shard.costmodel.step_time", frozenset({"constant", "parameter"})):
        "a fused update body's leaves (update_region_fallback's fusions)",
    ("hlo_shard.costmodel.step_time", frozenset({"concatenate", "tuple"})):
        "where several weights' work meets: buckets and tuples",
    ("hlo_shard.runtime.inputs", frozenset({"all-reduce", "tuple"})):
        "the producers whose operand i is a get-tuple-element's element i",
    # XLA's HloCostAnalysis, rule by rule as its source has it.
    ("hlo_shard.costmodel.flops", frozenset({"broadcast", "reshape"})):
        "XLA's fusion operand utilization: users that read a value whole",
    ("hlo_shard.costmodel.flops", frozenset({"gather", "scatter"})):
        "XLA's kCustom fusion rule (a gather or scatter fusion priced as its root op)",
    # The attribute table: which attributes each opcode takes (a table per opcode itself).
    ("hlo_shard.attributes", frozenset("""acos acosh asin asinh atanh cbrt cosh cosine erf
        exponential exponential-minus-one log log-plus-one logistic rsqrt sine sinh sqrt tan
        tanh""".split())): "the unary ops that take result_accuracy=",
    ("hlo_shard.attributes", frozenset({"broadcast", "concatenate", "get-dimension-size",
                                        "reverse", "set-dimension-size", "transpose"})):
        "the ops that take dimensions= alone",
    ("hlo_shard.attributes", frozenset({"recv", "recv-done", "send", "send-done"})):
        "the ops that take channel_id= and is_host_transfer=",
    ("hlo_shard.attributes", frozenset({"scatter", "select"})):
        "attribute names that are also opcode names (select-and-scatter's)",
    # Collective *kinds* (the cost model's names for what a collective does).
    ("hlo_shard.profiles", frozenset({"all-gather", "all-reduce", "reduce-scatter"})):
        "the kinds XLA has a combiner pass for: the profile schema's choices",
    ("hlo_shard.passes.weight_update.emit", frozenset({"slice", "transpose"})):
        "the ops the emitter writes as a loop fusion of their own in a fused module "
        "(XLA:CPU's kernels: a top-level transpose's slow generic kernel, a kernel per "
        "top-level slice)",
    # What the fuzzer and the mutant generator emit: choices, not facts.
    ("hlo_shard.fuzz.frontend", frozenset({
        "abs", "copy", "cosine", "exponential", "floor", "log", "logistic", "negate", "rsqrt",
        "sign", "sine", "sqrt", "tanh"})): "unary ops the fuzzer emits",
    ("hlo_shard.fuzz.frontend", frozenset({
        "add", "atan2", "divide", "maximum", "minimum", "multiply", "power", "remainder",
        "subtract"})): "binary ops the fuzzer emits",
    ("hlo_shard.fuzz.frontend", frozenset({"abs", "copy", "negate"})):
        "a conditional branch's op",
    ("hlo_shard.fuzz.frontend", frozenset({
        "after-all", "bitcast-convert", "clamp", "convert", "custom-call", "opt-barrier",
        "partition-id", "reduce-precision", "replica-id", "rng-bit-generator", "tuple"})):
        "the fuzzer's other ops",
    ("hlo_shard.fuzz.frontend", frozenset({
        "convolution", "dot", "gather", "map", "reduce", "reduce-window", "scatter",
        "select-and-scatter", "sort"})): "the fuzzer's ops with attributes or callees",
    ("hlo_shard.fuzz.frontend", frozenset({"call", "conditional", "fusion", "while"})):
        "the fuzzer's control flow",
    ("hlo_shard.fuzz.frontend", frozenset({"call", "fusion"})): "its branch emitting callees",
    ("hlo_shard.fuzz.frontend", frozenset({"bitcast", "reshape"})): "its branch of flat views",
    ("hlo_shard.fuzz.frontend", frozenset({"bitcast-convert", "convert"})):
        "its branch of conversions",
    ("hlo_shard.fuzz.frontend", frozenset({"partition-id", "replica-id"})):
        "its branch of device ids",
    ("hlo_shard.fuzz.mutants", frozenset({"all-gather", "reduce-scatter"})):
        "the opcode prefixes whose groups a mutant reorders",
    ("hlo_shard.fuzz.steps", frozenset({"maximum", "minimum"})): "a generated step's extremum",
}


def _all_opcode_literals(source: str) -> set[frozenset[str]]:
    """Every literal set, list or tuple of two or more opcode names in ``source``, at any
    depth (``inst.opcode in ("a", "b")`` as well as a module's constant)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = _literal_strings(node)
        if len(names) >= 2 and names <= opinfo.OPCODES:
            found.add(names)
    return found


def _package_opcode_literals() -> set[tuple[str, frozenset[str]]]:
    return {(module, names) for module, source in _package_sources()
            for names in _all_opcode_literals(source)}


def test_no_literal_opcode_set_is_left_outside_the_table():
    """A decision by what an opcode *is* reads an :class:`~hlo_shard.opinfo.OpInfo` field
    (or a set derived from the table); a literal list of opcodes in a module is one of the
    documented exceptions below, and an exception no longer in the code is removed."""
    found = _package_opcode_literals()
    assert {f"{module}: {sorted(names)}" for module, names in found
            if (module, names) not in LITERAL_SETS_ALLOWED} == set()
    assert {f"{module}: {sorted(names)}" for module, names in LITERAL_SETS_ALLOWED
            if (module, names) not in found} == set()


def test_the_literal_finder_looks_inside_functions():
    source = ('def f(inst):\n    return inst.opcode in ("reshape", "copy") or '
              'inst.opcode == "add"\nK = ("all-reduce", "not-an-opcode")\n')
    assert _all_opcode_literals(source) == {frozenset({"reshape", "copy"})}


def test_views_move_one_operand_one_to_one():
    for name in opinfo.VIEWS:
        assert OPINFO[name].arity == (1, 1) and OPINFO[name].values == opinfo.DETERMINISTIC
    assert opinfo.VIEWS == opinfo.ORDER_KEEPING_VIEWS | {"transpose"}
    assert opinfo.SHAPE_VIEWS == opinfo.VIEWS - {"copy"}
    assert opinfo.LOGICAL_VIEWS == opinfo.SHAPE_VIEWS - {"bitcast"}
    assert opinfo.moves("reshape") == opinfo.RESHAPE and opinfo.moves("no-such-op") == ""


def test_fusion_and_in_place_default_to_the_ops_priced_per_element():
    assert opinfo.PER_ELEMENT_COST <= opinfo.FUSIBLE and opinfo.PER_ELEMENT_COST <= opinfo.IN_PLACE
    assert opinfo.KERNEL_ROOTS <= opinfo.FUSIBLE
    assert opinfo.OpInfo("x", cost=opinfo.FLOP).fusion == opinfo.LOOP
    assert opinfo.OpInfo("x").fusion == "" and opinfo.OpInfo("x").in_place is False
    assert opinfo.OpInfo("x", cost=opinfo.FLOP, fusion="").fusion == ""  # stated wins


def test_grouped_collectives_are_those_with_replica_groups():
    from hlo_shard.attributes import OPCODE_ATTRIBUTES

    assert opinfo.GROUPED == {op for op in opinfo.OPCODES
                              if "replica_groups" in OPCODE_ATTRIBUTES.get(op, ())}


def test_ops_that_call_computations_name_them_in_their_attributes():
    from hlo_shard.attributes import OPCODE_ATTRIBUTES

    callee = {"calls", "to_apply", "body", "branch_computations"}
    for name in opcodes_where(lambda i: i.calls != ""):
        assert callee & set(OPCODE_ATTRIBUTES[name]), name


def test_device_ids_and_matmuls():
    for name in opinfo.DEVICE_IDS:
        assert OPINFO[name].arity == (0, 0) and OPINFO[name].values == opinfo.PER_DEVICE
    assert {"dot", "convolution"} <= opinfo.MATMULS


def test_zero_preserving_ops_map_zeros_to_zeros_on_xla():
    """Each ``zero_preserving`` op run by XLA (through jax.lax) on zeros, in every
    element type it takes here."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax import lax

    ops = {"add": lax.add, "subtract": lax.sub, "maximum": lax.max, "minimum": lax.min,
           "negate": lax.neg, "abs": lax.abs, "sqrt": lax.sqrt, "sign": lax.sign,
           "tanh": lax.tanh, "sine": lax.sin,
           "convert": lambda x: lax.convert_element_type(x, jnp.bfloat16),
           "bitcast-convert": lambda x: lax.bitcast_convert_type(x, jnp.int32),
           "and": lambda x, y: lax.bitwise_and(x.astype(jnp.int32), y.astype(jnp.int32)),
           "or": lambda x, y: lax.bitwise_or(x.astype(jnp.int32), y.astype(jnp.int32))}
    assert set(ops) == opinfo.ZERO_PRESERVING
    arities = {name: OPINFO[name].arity[0] for name in ops}
    for dtype in (jnp.float32, jnp.bfloat16):
        zeros = jnp.zeros((4,), dtype)
        for name, fn in ops.items():
            if name == "bitcast-convert" and dtype != jnp.float32:
                continue
            result = jax.jit(fn)(*[zeros] * arities[name])
            assert not jnp.any(result.astype(jnp.float32) != 0), (name, dtype)


def test_reducer_neutral_elements_are_identities_on_xla():
    """op(x, neutral) = x for each reducer's ``neutral`` in each family it states."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from hlo_shard.analysis.collectives import neutral_literal

    fns = {"add": jnp.add, "multiply": jnp.multiply, "maximum": jnp.maximum,
           "minimum": jnp.minimum, "and": jnp.bitwise_and, "or": jnp.bitwise_or}
    reducers = opcodes_where(lambda i: bool(i.neutral))
    assert reducers == set(fns)
    samples = {"float": ("f32", np.array([-2.5, 0.0, 3.0], np.float32)),
               "int": ("s32", np.array([-7, 0, 9], np.int32)),
               "pred": ("pred", np.array([True, False, True]))}
    for name in reducers:
        for family, _ in OPINFO[name].neutral:
            element_type, x = samples[family]
            text = neutral_literal(name, element_type)
            value = {"true": True, "false": False}.get(text, None)
            neutral = np.array(value if value is not None else int(text) if family == "int"
                               else float(text), x.dtype)
            result = jax.jit(fns[name])(jnp.asarray(x), jnp.full(x.shape, neutral))
            assert np.array_equal(np.asarray(result), x), (name, family)
