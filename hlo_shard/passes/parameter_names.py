"""The user's names of a module's entry parameters, written into the module: what
``hlo_shard.jax.per_device_hlo`` hands the command line where a library's jit wrapper
(``nnx.jit``, ``eqx.filter_jit``) names its own ``jax.jit``'s arguments its own way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hlo_shard.analysis.names import with_op_name
from hlo_shard.graph import ModuleRewriter
from hlo_shard.ir import Module
from hlo_shard.passes.base import ModulePass


@dataclass(frozen=True)
class ParameterOpNames(ModulePass[None]):
    """Each entry parameter numbered in ``names`` given that ``op_name`` in its metadata:
    the user's path of the argument where a library's jit wrapper (``nnx.jit``,
    ``eqx.filter_jit``) names its own ``jax.jit``'s arguments its own way, so that a
    reader of the text (``report``, ``--explain``) names the weights as
    :func:`~hlo_shard.jax.shard_weight_update`'s report does."""

    name: ClassVar[str] = "parameter-op-names"
    names: tuple[tuple[int, str], ...] = ()

    def apply(self, module: Module, rewriter: ModuleRewriter) -> None:
        rw = rewriter.rewriter(module.entry)
        named = dict(self.names)
        for param in module.entry.parameters():
            name = named.get(param.parameter_number) if param.parameter_number is not None \
                else None
            if name:
                rw.set_attr(param, "metadata", with_op_name(param, name))


__all__ = ["ParameterOpNames"]
