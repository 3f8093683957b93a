"""Liveness follows XLA's buffer assignment conventions (small hand-written modules;
the fixtures against XLA itself are in test_memory_optimized.py and test_cost_xla.py)."""

from __future__ import annotations

from hlo_shard.costmodel.memory import memory_profile
from hlo_shard.parser import parse

ADD = """
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""


def _elementwise_pair(result_layout: str) -> str:
    return f"""
HloModule pair, is_scheduled=true

exp {{
  x = f32[16,16]{{1,0}} parameter(0)
  ROOT e = f32[16,16]{{1,0}} exponential(x)
}}
neg {{
  y = f32[16,16]{{1,0}} parameter(0)
  ROOT n = f32[16,16]{result_layout} negate(y)
}}
ENTRY e {{
  p = f32[16,16]{{1,0}} parameter(0)
  a = f32[16,16]{{1,0}} fusion(p), kind=kLoop, calls=exp
  ROOT b = f32[16,16]{result_layout} fusion(a), kind=kLoop, calls=neg
}}
"""


def test_a_loop_writes_over_its_operand_only_in_the_same_layout():
    same = memory_profile(parse(_elementwise_pair("{1,0}")))
    transposed = memory_profile(parse(_elementwise_pair("{0,1}")))
    assert same.temp_bytes == 0  # `a` lives in the output's allocation, `b` over it
    assert transposed.temp_bytes == 16 * 16 * 4  # `b` must not overwrite what it reads


def test_a_tuple_result_has_an_address_table_in_the_temp_allocation():
    module = parse(f"""
HloModule combined, is_scheduled=true, replica_count=2
{ADD}
sum {{
  u = f32[16] parameter(0)
  v = f32[16] parameter(1)
  ROOT w = f32[16] add(u, v)
}}
ENTRY e {{
  p = f32[16] parameter(0)
  q = f32[16] parameter(1)
  ar = (f32[16], f32[16]) all-reduce(p, q), replica_groups={{}}, to_apply=add
  g0 = f32[16] get-tuple-element(ar), index=0
  g1 = f32[16] get-tuple-element(ar), index=1
  ROOT s = f32[16] fusion(g0, g1), kind=kLoop, calls=sum
}}
""")
    # g0 is written over by the output; g1 (64 B) and the 2-pointer table (16 B)
    # are temporaries, each 64-byte aligned.
    assert memory_profile(module).temp_bytes == 64 + 64


def test_a_loop_leaves_an_unchanged_carry_element_in_its_parameter():
    module = parse(f"""
HloModule loop
{ADD}
cond {{
  c = (s32[], f32[1024], f32[16]) parameter(0)
  i = s32[] get-tuple-element(c), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}}
body {{
  c = (s32[], f32[1024], f32[16]) parameter(0)
  i = s32[] get-tuple-element(c), index=0
  one = s32[] constant(1)
  j = s32[] add(i, one)
  table = f32[1024] get-tuple-element(c), index=1
  x = f32[16] get-tuple-element(c), index=2
  y = f32[16] multiply(x, x)
  ROOT next = (s32[], f32[1024], f32[16]) tuple(j, table, y)
}}
ENTRY e {{
  big = f32[1024] parameter(0)
  x0 = f32[16] parameter(1)
  zero = s32[] constant(0)
  init = (s32[], f32[1024], f32[16]) tuple(zero, big, x0)
  loop = (s32[], f32[1024], f32[16]) while(init), condition=cond, body=body
  ROOT out = f32[16] get-tuple-element(loop), index=2
}}
""")
    profile = memory_profile(module)
    assert profile.temp_bytes < 1024 * 4  # the f32[1024] table is never copied
