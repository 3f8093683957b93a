"""The small passes the optimizer runs around the weight-update pass: tuple forwarding
(on the computations the sharding edits), channel-id dedupe, entry-layout update; their
notes reach ``--explain``/``--json`` as before the split, and a pipeline leaves to a
later pass only the check that pass repairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hlo_shard.cli import main
from hlo_shard.parser import parse
from hlo_shard.passes.channel_dedupe import ChannelIdDedupe
from hlo_shard.passes.entry_layout import EntryLayoutUpdate
from hlo_shard.passes.pipeline import PassCheckError, Pipeline, validate_printed
from hlo_shard.passes.registry import parse_pipeline
from hlo_shard.passes.tuple_forwarding import TupleForwarding
from hlo_shard.passes.weight_update import rewritten_computations
from hlo_shard.printer import to_text

from wus_helpers import ADD, MAX

GOLDEN = Path(__file__).parent / "golden_pass"

#: Two max all-reduces (not gradients) sharing a channel id.
SHARED_IDS = f"""HloModule shared, replica_count=2, num_partitions=2
{ADD}
{MAX}
ENTRY e {{ w = f32[8] parameter(0) g = f32[8] parameter(1)
 ar = f32[8] all-reduce(g), replica_groups={{{{0,1}}}}, to_apply=add
 m1 = f32[8] all-reduce(w), channel_id=3, replica_groups={{{{0,1}}}}, to_apply=mx
 m2 = f32[8] all-reduce(g), channel_id=3, replica_groups={{{{0,1}}}}, to_apply=mx
 s = f32[8] add(m1, m2)
 u = f32[8] subtract(w, ar)
 ROOT t = (f32[8], f32[8]) tuple(u, s) }}
"""

LAYOUT = f"""HloModule adam, replica_count=2, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias) }}, entry_computation_layout={{(f32[8]{{0}}, f32[8]{{0}}, /*index=2*/f32[8]{{0}})->(f32[8]{{0}}, f32[8]{{0}})}}
{ADD}
ENTRY e {{ w = f32[8] parameter(0) m = f32[8] parameter(1)
 x = f32[8] parameter(2), parameter_replication={{false}}
 g = f32[8] multiply(w, x)
 ar = f32[8] all-reduce(g), replica_groups={{{{0,1}}}}, to_apply=add
 nm = f32[8] add(m, ar)
 nw = f32[8] subtract(w, nm)
 ROOT t = (f32[8], f32[8]) tuple(nw, nm) }}
"""


def test_every_pass_note_reaches_explain_and_json_in_pass_order(tmp_path):
    path, out = tmp_path / "in.hlo", tmp_path / "out.hlo"
    path.write_text(SHARED_IDS)
    result = CliRunner().invoke(main, ["optimize", "--force", str(path), "-o", str(out),
                                       "--explain", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["notes"] == [
        "renumbered 1 duplicate collective channel id(s)"]
    assert "note: renumbered 1 duplicate collective channel id(s)" in result.stderr
    written = out.read_text()
    assert "channel_id=3" in written and "channel_id=4" in written


def test_a_pipeline_defers_a_check_only_to_the_pass_that_repairs_it():
    with pytest.raises(PassCheckError, match="weight-update-sharding.*entry-layout"):
        Pipeline(parse_pipeline("weight-update-sharding{state=sharded}"),
                 check=validate_printed).run(parse(LAYOUT))
    result = Pipeline(parse_pipeline("weight-update-sharding{state=sharded},"
                                     "entry-layout-update"), check=validate_printed
                      ).run(parse(LAYOUT))
    assert result.results[-1].changed
    assert "entry_computation_layout={(f32[8], f32[4], f32[8])->(f32[8], f32[4])}" \
        in to_text(result.module)
    # The input's own duplicate channel ids are no pass's slip (each pass is held to
    # adding no kind of problem the input lacks); the output check still refuses them.
    kept = Pipeline([TupleForwarding(())], check=validate_printed).run(parse(SHARED_IDS))
    assert any("unique-channel-ids" in str(p) for p in validate_printed(kept.module))
    Pipeline([TupleForwarding(()), ChannelIdDedupe()], check=validate_printed).run(
        parse(SHARED_IDS))


def test_a_matching_entry_layout_keeps_its_text():
    module = parse(LAYOUT)
    before = to_text(module)
    result = EntryLayoutUpdate().run(module)
    assert not result.changed and result.report.layout is None
    assert to_text(module) == before and "/*index=2*/" in before
    assert not EntryLayoutUpdate().run(parse(LAYOUT.split(", entry_computation")[0] + "\n"
                                               + LAYOUT.split("\n", 1)[1])).changed


def test_unique_channel_ids_are_left_alone():
    module = parse(SHARED_IDS.replace("channel_id=3, replica_groups={{0,1}}, to_apply=mx\n s",
                                      "channel_id=5, replica_groups={{0,1}}, to_apply=mx\n s"))
    result = ChannelIdDedupe().run(module)
    assert not result.changed and result.report.notes == []


def test_tuple_forwarding_edits_what_the_sharding_edits_by_default():
    loop = parse((GOLDEN / "while_loop_body.hlo").read_text())
    assert rewritten_computations(loop) == ["body", "e"]  # the body and the loop's caller
    wrapped = f"""HloModule wrapped, replica_count=2
{ADD}
helper {{ a = f32[8] parameter(0) t = (f32[8], f32[8]) tuple(a, a)
 ROOT x = f32[8] get-tuple-element(t), index=0 }}
ENTRY e {{ w = f32[8] parameter(0) g = f32[8] parameter(1)
 ar = f32[8] all-reduce(g), replica_groups={{{{0,1}}}}, to_apply=add
 t = (f32[8], f32[8]) tuple(ar, w)
 grad = f32[8] get-tuple-element(t), index=0
 c = f32[8] call(w), to_apply=helper
 u = f32[8] subtract(c, grad)
 ROOT nw = f32[8] subtract(w, u) }}
"""
    module = parse(wrapped)
    result = TupleForwarding().run(module)
    assert result.changed and result.report.forwarded == {"e": 1}
    assert "get-tuple-element" not in to_text(module).split("ENTRY")[1]
    assert "get-tuple-element" in to_text(module).split("ENTRY")[0]  # helper: left alone
    again = TupleForwarding().run(module)
    assert not again.changed and again.report.forwarded == {}
