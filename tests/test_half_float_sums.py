"""bf16 gradients are summed as the backend sums them: in f32 where it sums bf16 in f32
(XLA:CPU, the CPU profiles' ``upcasts_16bit_floats``), in bf16 elsewhere; f16 in f16 on
both (XLA:CPU adds f16 in f16, device after device). The numbers through real XLA: ``test_jax_master_weights`` (bf16 weights
and bf16 compute, jit's steps) and ``test_accumulation`` (the motion's ``narrow-write``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hlo_shard.costmodel.network import payload_bytes
from hlo_shard.parser import parse, parse_file
from hlo_shard.passes.optimize import optimize
from hlo_shard.passes.weight_update import ShardingOptions
from hlo_shard.profiles import resolve_profile

BF16_PARAMS = Path(__file__).resolve().parent.parent / "fixtures" / "spmd" / "bf16_params.n4.hlo"


def sharded(profile: str) -> str:
    module = parse_file(BF16_PARAMS)
    return optimize(module, ShardingOptions(profile=resolve_profile(profile)), force=True).text


def test_bf16_gradients_are_reduce_scattered_in_f32_where_the_backend_sums_them_so():
    """Each bf16 gradient converted to f32 before it is bucketed, the bucket summed by an
    f32 add, each shard converted back to bf16 for the update: the sum XLA:CPU makes of
    the all-reduce, from each device's unrounded value."""
    text = sharded("cpu-local")
    scatters = re.findall(r"= (\w+)\[[\d,]*\]\S* reduce-scatter\(.*to_apply=%([\w.]+)", text)
    assert scatters and {kind for kind, _ in scatters} == {"f32"}, scatters
    reducers = {name for _, name in scatters}
    assert all(re.search(rf"%{re.escape(name)} \(lhs: f32\[\], rhs: f32\[\]\) -> f32\[\]", text)
               for name in reducers), reducers
    buckets = re.findall(r"%gradient_bucket[.\d]* = (\w+)\[", text)
    assert buckets and set(buckets) == {"f32"}, buckets
    # the four gradients (each psum's operand) widened, each psum's shard narrowed back
    widened = re.findall(r"%[\w.]+\.f32\.\d+ = f32\[[\d,]*\]\S* convert\(%([\w.]+)\)", text)
    assert len(widened) == 4, widened
    narrowed = re.findall(r"= bf16\[\d+\]\S* convert\(%(psum\.\d+)\.shard", text)
    assert len(narrowed) == 4, narrowed


def test_bf16_gradients_are_reduce_scattered_in_bf16_where_the_backend_sums_bf16():
    text = sharded("h100")
    scatters = re.findall(r"= (\w+)\[[\d,]*\]\S* reduce-scatter\(", text)
    assert scatters and set(scatters) == {"bf16"}, scatters
    assert "sum_f32" not in text


_COLLECTIVES = """HloModule m, replica_count=4

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%add16 (c: f16[], d: f16[]) -> f16[] {
  %c = f16[] parameter(0)
  %d = f16[] parameter(1)
  ROOT %t = f16[] add(%c, %d)
}

%add32 (e: f32[], f: f32[]) -> f32[] {
  %e = f32[] parameter(0)
  %f = f32[] parameter(1)
  ROOT %u = f32[] add(%e, %f)
}

ENTRY %main {
  %p = bf16[64] parameter(0)
  %q = bf16[16] parameter(1)
  %r = f32[64] parameter(2)
  %h = f16[64] parameter(3)
  %sum = bf16[64] all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %gathered = bf16[64] all-gather(%q), replica_groups={{0,1,2,3}}, dimensions={0}
  %wide = f32[64] all-reduce(%r), replica_groups={{0,1,2,3}}, to_apply=%add32
  %half = f16[64] all-reduce(%h), replica_groups={{0,1,2,3}}, to_apply=%add16
  ROOT %out = (bf16[64], bf16[64], f32[64], f16[64]) tuple(%sum, %gathered, %wide, %half)
}
"""


@pytest.mark.parametrize("name,plain,upcast", [("sum", 128, 256), ("gathered", 128, 128),
                                               ("wide", 256, 256), ("half", 128, 128)])
def test_a_bf16_sum_is_priced_as_the_f32_sum_the_backend_makes(name, plain, upcast):
    """A summing collective of bf16 moves f32 on a backend that upcasts (what XLA:CPU
    runs: the input's all-reduce and the pass's reduce-scatter priced alike); an
    all-gather moves the values as they are, and an f16 sum is made in f16."""
    module = parse(_COLLECTIVES)
    inst = module.entry[name]
    shapes = [module.entry[o].shape for o in inst.operands]
    assert payload_bytes(inst, shapes) == plain
    assert payload_bytes(inst, shapes, upcast=True) == upcast
