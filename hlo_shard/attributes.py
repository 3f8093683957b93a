"""Which attributes each opcode takes, as XLA's parser decides (tables, no logic).

XLA's ``HloParserImpl::ParseInstructionRhs`` (xla/hlo/parser/hlo_parser.cc) gives each
opcode a map of the attributes it reads, on top of those every instruction takes, and
refuses any other name ("unexpected attribute"); ``CreateInstruction`` then refuses a
missing required one. The sets below are the ones jaxlib's parser lists in its own
"Allowed attributes: ..." message, opcode by opcode.
"""

from __future__ import annotations

#: Attributes every instruction takes (the attrs map ParseInstruction starts with).
COMMON_ATTRIBUTES = frozenset({
    "sharding", "frontend_attributes", "statistics", "parameter_replication",
    "control-predecessors", "metadata", "backend_config", "origin",
})

_COLLECTIVE = ("channel_id", "replica_groups")
_ALL_REDUCE = (*_COLLECTIVE, "to_apply", "constrain_layout", "use_global_device_ids", "mode")
_ALL_GATHER = (*_COLLECTIVE, "dimensions", "constrain_layout", "use_global_device_ids")
_DOT = ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims",
        "operand_precision")
_UNARY_WITH_ACCURACY = """acos acosh asin asinh atanh cbrt cosh cosine erf exponential
exponential-minus-one log log-plus-one logistic rsqrt sine sinh sqrt tan tanh""".split()

#: The attributes an opcode takes besides :data:`COMMON_ATTRIBUTES`; the default (an
#: opcode not listed, elementwise ops among them) takes none. ``conditional`` takes
#: both spellings here; the parser then keeps the one its first operand's type selects
#: (:data:`CONDITIONAL_FORMS`).
OPCODE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    **{op: ("result_accuracy",) for op in _UNARY_WITH_ACCURACY},
    "all-reduce": _ALL_REDUCE, "all-reduce-start": _ALL_REDUCE,
    "reduce-scatter": (*_ALL_REDUCE, "dimensions"),
    "all-gather": _ALL_GATHER, "all-gather-start": _ALL_GATHER,
    "all-to-all": (*_COLLECTIVE, "dimensions", "constrain_layout"),
    "ragged-all-to-all": (*_COLLECTIVE, "dimensions"),
    "collective-broadcast": _COLLECTIVE,
    "collective-permute": ("channel_id", "source_target_pairs", "slice_sizes"),
    "collective-permute-start": ("channel_id", "source_target_pairs", "slice_sizes"),
    **{op: ("channel_id", "is_host_transfer") for op in ("send", "send-done", "recv",
                                                        "recv-done")},
    "async-start": ("calls", "async_execution_thread", "output_to_operand_aliasing"),
    "async-update": ("calls", "async_execution_thread"),
    "async-done": ("calls", "async_execution_thread"),
    "copy-start": ("cross_program_prefetch_index",),
    **{op: ("dimensions",) for op in ("broadcast", "concatenate", "get-dimension-size",
                                      "reverse", "set-dimension-size", "transpose")},
    "batch-norm-training": ("epsilon", "feature_index"),
    "batch-norm-inference": ("epsilon", "feature_index"),
    "batch-norm-grad": ("epsilon", "feature_index"),
    "call": ("to_apply", "is_composite"),
    "cholesky": ("lower",),
    "compare": ("direction", "type"),
    "conditional": ("true_computation", "false_computation", "branch_computations"),
    "convolution": ("window", "dim_labels", "feature_group_count", "batch_group_count",
                    "operand_precision", "convolution_kind", "sparsity_config"),
    "custom-call": ("custom_call_target", "window", "dim_labels", "feature_group_count",
                    "batch_group_count", "operand_layout_constraints",
                    "custom_call_has_side_effect", "to_apply", "called_computations",
                    "output_to_operand_aliasing", "padding_type", "literal",
                    "operand_precision", "schedule", "api_version"),
    "domain": ("domain",),
    "dot": (*_DOT, "algorithm"), "scaled-dot": (*_DOT, "algorithm"),
    "ragged-dot": (*_DOT, "lhs_ragged_dims", "rhs_group_dims"),
    "dynamic-slice": ("dynamic_slice_sizes",),
    "fft": ("fft_type", "fft_length"),
    "fusion": ("kind", "calls", "output_to_operand_aliasing"),
    "gather": ("offset_dims", "collapsed_slice_dims", "start_index_map", "index_vector_dim",
               "slice_sizes", "indices_are_sorted", "operand_batching_dims",
               "start_indices_batching_dims"),
    "get-tuple-element": ("index",),
    "infeed": ("infeed_config",),
    "iota": ("iota_dimension",),
    "map": ("to_apply", "dimensions"), "reduce": ("to_apply", "dimensions"),
    "outfeed": ("outfeed_config", "outfeed_shape"),
    "pad": ("padding",),
    "reduce-precision": ("exponent_bits", "mantissa_bits"),
    "reduce-window": ("to_apply", "window"),
    "reshape": ("inferred_dimension",),
    "rng": ("distribution",),
    "rng-bit-generator": ("algorithm",),
    "rng-get-and-update-state": ("delta",),
    "scan": ("to_apply", "dimensions", "num_carries", "is_reverse", "is_associative"),
    "scatter": ("update_window_dims", "inserted_window_dims", "scatter_dims_to_operand_dims",
                "index_vector_dim", "to_apply", "indices_are_sorted", "unique_indices",
                "input_batching_dims", "scatter_indices_batching_dims"),
    "select-and-scatter": ("select", "scatter", "window"),
    "slice": ("slice",),
    "sort": ("dimensions", "to_apply", "is_stable"),
    "topk": ("k", "largest"),
    "triangular-solve": ("left_side", "lower", "unit_diagonal", "transpose_a"),
    "while": ("condition", "body"),
}

#: What XLA's async sugar adds to the wrapped op's attributes: ``<op>-start`` takes the
#: op's own attributes plus these, ``<op>-update`` and ``<op>-done`` only these.
ASYNC_SUGAR_ATTRIBUTES = {
    "-start": ("async_execution_thread", "output_to_operand_aliasing"),
    "-update": ("async_execution_thread",),
    "-done": ("async_execution_thread",),
}

#: Attributes XLA's parser requires per opcode (``CreateInstruction``): a module
#: without them is refused there, and passes rely on them being present.
REQUIRED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "all-reduce": ("to_apply",), "all-reduce-start": ("to_apply",),
    "reduce-scatter": ("to_apply", "dimensions"), "all-gather": ("dimensions",),
    "all-gather-start": ("dimensions",), "reduce": ("to_apply", "dimensions"),
    "reduce-window": ("to_apply",), "sort": ("dimensions", "to_apply"), "map": ("to_apply",),
    "scatter": ("to_apply",), "call": ("to_apply",), "while": ("condition", "body"),
    "fusion": ("calls", "kind"), "get-tuple-element": ("index",), "iota": ("iota_dimension",),
    "compare": ("direction",), "dynamic-slice": ("dynamic_slice_sizes",), "slice": ("slice",),
    "transpose": ("dimensions",), "reverse": ("dimensions",), "concatenate": ("dimensions",),
    "pad": ("padding",), "select-and-scatter": ("select", "scatter"),
    "custom-call": ("custom_call_target",), "collective-permute": ("source_target_pairs",),
    "convolution": ("dim_labels",),
}

#: ``OpMetadata`` fields ``ParseMetadata`` reads, by value kind: quoted strings, int32
#: numbers, and ``profile_type={1,2}`` (a braced list of integers).
METADATA_STRING_FIELDS = frozenset({
    "op_type", "op_name", "source_file", "deduplicated_name", "scheduling_name",
    "metadata_payload",
})
METADATA_INT_FIELDS = frozenset({
    "source_line", "source_end_line", "source_column", "source_end_column", "stack_frame_id",
})
METADATA_FIELDS = METADATA_STRING_FIELDS | METADATA_INT_FIELDS | {"profile_type"}

#: The ``HloModule name, key=value`` attributes XLA's ``ParseHloModule`` reads; any other
#: key is refused there ("unexpected attribute").
HEADER_ATTRIBUTES = frozenset({
    "alias_passthrough_params", "allow_spmd_sharding_propagation_to_output",
    "allow_spmd_sharding_propagation_to_parameters", "buffer_donor",
    "entry_computation_layout", "frontend_attributes", "input_output_alias", "is_scheduled",
    "num_partitions", "origin_recovery_table", "replica_count",
})

#: ``conditional`` takes one of two attribute sets, chosen by its first operand's type:
#: a ``pred`` selects between two computations, an ``s32`` index among a list.
CONDITIONAL_FORMS = {
    True: ("true_computation", "false_computation"),
    False: ("branch_computations",),
}
