"""Opcode families shared by the analyses (one table each, so the rules agree)."""

from __future__ import annotations

from hlo_shard.ir import ArrayShape, Computation

#: Elementwise ops: result[i] depends only on operands[i] (same dims; clamp may take scalar
#: bounds). They run unchanged on any subset of the elements — the shardable core.
ELEMENTWISE = frozenset({
    # unary
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cbrt", "ceil", "cosine", "cosh",
    "count-leading-zeros", "erf", "exponential", "exponential-minus-one", "floor", "imag",
    "is-finite", "log", "log-plus-one", "logistic", "negate", "not", "popcnt", "real",
    "reduce-precision", "round-nearest-afz", "round-nearest-even", "rsqrt", "sign", "sine",
    "sinh", "sqrt", "tan", "tanh", "convert", "copy",
    # binary
    "add", "atan2", "complex", "divide", "maximum", "minimum", "multiply", "power", "remainder",
    "shift-left", "shift-right-arithmetic", "shift-right-logical", "subtract", "and", "or",
    "xor", "compare",
    # ternary
    "select", "clamp",
})

#: Ops whose result is a deterministic function of their operands' values: identical
#: operands on every device give identical results.
DETERMINISTIC = ELEMENTWISE | frozenset({
    "bitcast-convert", "stochastic-convert", "broadcast", "reshape", "bitcast", "transpose",
    "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "reverse", "iota",
    "constant", "dot", "convolution", "reduce", "reduce-window", "map", "sort", "gather",
    "scatter", "select-and-scatter", "cholesky", "triangular-solve", "fft",
    "get-dimension-size", "set-dimension-size", "dynamic-reshape", "topk", "batch-norm-training",
    "batch-norm-inference", "batch-norm-grad", "domain", "ragged-dot", "scaled-dot",
})

#: Ops whose value differs per device or is not a function of the operands.
DEVICE_DEPENDENT = frozenset({
    "replica-id", "partition-id", "rng", "rng-bit-generator", "rng-get-and-update-state",
    "infeed", "recv", "recv-done", "custom-call", "reduce-scatter", "all-to-all",
    "ragged-all-to-all", "collective-permute", "collective-permute-start",
    "collective-permute-done", "collective-broadcast",
})


#: Inside an elementwise fusion body: opcodes allowed besides :data:`ELEMENTWISE`.
_BODY_EXTRA = frozenset({"parameter", "constant", "broadcast"})


def is_elementwise_body(comp: Computation, dims: tuple[int, ...]) -> bool:
    """Every value is ``dims``-shaped or a scalar, every array op elementwise; constants
    are scalars and broadcasts spread scalars — so the body computes element i of its
    result from element i of its operands."""
    for inst in comp.instructions:
        shape = inst.shape
        if not isinstance(shape, ArrayShape) or shape.dynamic or (
                shape.dims != dims and not shape.is_scalar):
            return False
        if inst.opcode not in ELEMENTWISE and inst.opcode not in _BODY_EXTRA:
            return False
        if inst.opcode == "constant" and not shape.is_scalar:
            return False
        if inst.opcode == "broadcast":
            operand = comp[inst.operands[0]].shape
            if not (isinstance(operand, ArrayShape) and operand.is_scalar):
                return False
    return isinstance(comp.root.shape, ArrayShape) and comp.root.shape.dims == dims
