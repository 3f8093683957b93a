"""The structural validator: each check fires on a module broken in exactly that way."""

from __future__ import annotations

import pytest

from hlo_shard.ir import ArrayShape, Instruction
from hlo_shard.parser import parse
from hlo_shard.validate import validate

from wus_helpers import ADD

GOOD = f"""HloModule good, replica_count=4, entry_computation_layout={{(f32[8]{{0}})->f32[8]{{0}}}}
{ADD}
ENTRY e {{ g = f32[8] parameter(0)
 rs = f32[2] reduce-scatter(g), channel_id=1, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}, to_apply=add
 n = f32[2] negate(rs)
 ROOT ag = f32[8] all-gather(n), channel_id=2, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}} }}
"""


def checks(text: str) -> set[str]:
    return {p.check for p in validate(parse(text))}


def assert_only_problem(text: str, check: str, message: str | None) -> None:
    """``text``'s problems of ``check``: one, saying ``message`` (None: none)."""
    problems = [p for p in validate(parse(text)) if p.check == check]
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1 and message in problems[0].message, problems


def test_a_correct_module_passes():
    assert validate(parse(GOOD)) == []


@pytest.mark.parametrize("old, new, check", [
    ("f32[2] reduce-scatter", "f32[3] reduce-scatter", "shape"),
    # (the gathered shape stays the declared result: the parser checks that one)
    ("channel_id=2, replica_groups={{0,1,2,3}}", "channel_id=2, replica_groups={{0,1},{2,3}}",
     "shape"),
    ("channel_id=2", "channel_id=1", "unique-channel-ids"),
    ("{{0,1,2,3}}, dimensions={0} }", "{{0,1},{1,2,3}}, dimensions={0} }", "group-ids"),
    ("{{0,1,2,3}}, dimensions={0} }", "{{0,1},{2,4}}, dimensions={0} }", "replica-groups"),
    ("f32[2] negate", "f32[3] negate", "shape"),
])
def test_broken_modules_name_the_failed_check(old, new, check):
    assert old in GOOD
    assert check in checks(GOOD.replace(old, new))


def test_root_must_match_the_entry_layout():
    module = parse(GOOD)
    module.entry.root.shape = ArrayShape("f32", (4,))
    assert "entry-layout" in {p.check for p in validate(module)}


def test_use_before_definition_and_duplicate_names():
    module = parse(GOOD)
    entry = module.entry
    entry.instructions.insert(0, Instruction("early", "negate", ArrayShape("f32", (2,)), ["n"]))
    entry.instructions.append(Instruction("n", "negate", ArrayShape("f32", (2,)), ["rs"]))
    found = {p.check for p in validate(module)}
    assert {"def-before-use", "unique-names"} <= found


@pytest.mark.parametrize("header, check", [("", None), (", replica_count=4", None),
                                           (", replica_count=2", "shape")])
def test_a_gather_over_every_device_is_checked_where_the_header_counts_them(header, check):
    """An all-gather without groups (every device) in a module whose header says how many
    (XLA's own tests write such modules; XLA's pass hook prints no count): the header
    lost, the size is unknown, not one device (optimize refused to write XLA's test of
    it unchanged, "over groups of 1 cannot give [128, 128]")."""
    text = (f"HloModule m{header}\nENTRY e {{ p = f32[128,32]{{0,1}} parameter(0)\n"
            f" ROOT ag = f32[128,128]{{0,1}} all-gather(p), replica_groups={{}}, "
            f"dimensions={{1}} }}\n")
    found = checks(text)
    assert (check in found) if check else ("shape" not in found), validate(parse(text))


@pytest.mark.parametrize("body, check", [
    ("s = f32[5] slice(p), slice={[0:5]}", None),
    ("s = f32[5] slice(p), slice={[2:9]}", "shape"),
    ("s = f32[10] pad(p, z), padding=0_2", None),
    ("s = f32[11] pad(p, z), padding=0_2", "shape"),
    ("s = f32[2,4] reshape(p)", None),
    ("s = f32[3,3] reshape(p)", "shape"),
    ("s = f32[2,4]{1,0} bitcast(p)", None),
    ("s = s32[8]{0} bitcast(p)", None),
    # an [8] value read as [32] (a shard taken for the whole value): XLA refuses it
    ("s = f32[32]{0} bitcast(p)", "shape"),
    ("s = f32[8,3] broadcast(p), dimensions={0}", None),
    ("s = f32[3,8] broadcast(p), dimensions={0}", "shape"),
    ("s = f32[16] concatenate(p, p), dimensions={0}", None),
    ("s = f32[15] concatenate(p, p), dimensions={0}", "shape"),
    ("s = f32[] reduce(p, z), dimensions={0}, to_apply=add", None),
    ("s = f32[8] reduce(p, z), dimensions={0}, to_apply=add", "shape"),
    ("s = f32[4] dynamic-slice(p, i), dynamic_slice_sizes={4}", None),
    ("s = f32[4] dynamic-slice(p, i), dynamic_slice_sizes={9}", "shape"),
    ("s = u32[8] iota(), iota_dimension=0", None),
    ("s = pred[8] compare(p, p), direction=LT", None),
    ("s = f32[8] compare(p, p), direction=LT", "shape"),
])
def test_shape_rules_of_emitted_opcodes(body, check):
    text = (f"HloModule m\n{ADD}\nENTRY e {{ p = f32[8] parameter(0) z = f32[] constant(0) "
            f"i = u32[] constant(0) ROOT {body} }}\n")
    found = checks(text)
    if check is None:
        assert "shape" not in found, validate(parse(text))
    else:
        assert check in found


def test_a_scatter_whose_groups_cannot_give_its_result_is_refused_where_it_is_written():
    """A reduce-scatter of 7 over groups of 2 said to give 3: optimize read it, then
    refused to write "the optimized module", as if its own rewrite had slipped. Its
    groups say how many devices it spans, so the input is refused at its line."""
    from hlo_shard.errors import HloParseError
    from hlo_shard.validate import check_input

    text = (f"HloModule m\n{ADD}\nENTRY e {{ a = f32[7] parameter(0)\n"
            f" ROOT r = f32[3] reduce-scatter(a), replica_groups={{{{0,1}}}}, "
            f"dimensions={{0}}, to_apply=add }}\n")
    with pytest.raises(HloParseError, match="dimension 0 of \\[7\\] over groups of 2"):
        check_input(parse(text), "rs.hlo")
    check_input(parse(text.replace("f32[3] reduce", "f32[4] reduce")
                       .replace("f32[7]", "f32[8]")), "rs.hlo")


@pytest.mark.parametrize("aliases, message", [
    ("{0}: (0, {}), {1}: (1, {})", None),
    ("{5}: (0, {})", "output {5} and parameter (0, {}): the entry's result has no array leaf"),
    ("{0}: (9, {})", "output {0} and parameter (9, {}): the entry has no parameter 9"),
    ("{0}: (0, {1})", "output {0} and parameter (0, {1}): the parameter has no array leaf"),
    ("{0}: (2, {})", "output {0} and parameter (2, {}): 16 and 8 bytes"),
    ("{0}: (0, {}), {0}: (1, {})", "the output is aliased twice"),
    ("{0}: (0, {}), {1}: (0, {})", "the parameter is aliased twice"),
])
def test_aliases_pair_existing_leaves_of_one_size_once(aliases, message):
    """``input_output_alias`` entries XLA refuses (its parser, or its verifier when it
    compiles): optimize rewrote such steps and wrote them (a probe of XLA's tests); the
    check is an input check now."""
    text = (f"HloModule m, input_output_alias={{ {aliases} }}\nENTRY e {{ "
            f"a = f32[4] parameter(0) b = f32[4] parameter(1) c = f32[2] parameter(2) "
            f"x = f32[4] negate(a) y = f32[4] negate(b) ROOT t = (f32[4], f32[4]) tuple(x, y) }}\n")
    assert_only_problem(text, "aliases", message)


@pytest.mark.parametrize("body, message", [
    ("ROOT d = f32[2,4] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}", None),
    ("ROOT d = f32[3,2,4] dot(c, b3), lhs_batch_dims={0}, rhs_batch_dims={0}, "
     "lhs_contracting_dims={2}, rhs_contracting_dims={1}", None),
    ("ROOT d = f32[2,4] dot(a, b), lhs_contracting_dims={5}, rhs_contracting_dims={0}",
     "lhs contracting [5] and batch [] dimensions must each name one of the 2"),
    ("ROOT d = f32[2,3] dot(a, a), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "contracting dimensions of sizes [3] and [2] differ"),
    ("ROOT d = f32[4,2] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "result dims should be [2, 4]"),
    ("ROOT y = f32[1,2,1] convolution(x, k), window={size=1}, dim_labels=b0f_0io->b0f", None),
    ("ROOT y = f32[1,2,1] convolution(x, k), window={size=1}, dim_labels=00_01->10",
     "dim_labels=00_01->10 is not of the form"),
    ("ROOT y = f32[1,2,1] convolution(x, k), window={size=1}, dim_labels=xyz",
     "dim_labels=xyz is not of the form"),
    ("ROOT y = f32[1,2,1] convolution(x, k), window={size=1x1}, dim_labels=b0f_0io->b0f",
     "the window has 2 dimensions where the convolution has 1 spatial ones"),
    ("ROOT y = f32[1,2,1] convolution(x, k), window={size=1 stride=1x1}, "
     "dim_labels=b0f_0io->b0f", "window stride=1x1 does not give each of the 1 dimensions"),
    ("ROOT y = f32[1,2,1] convolution(x, k), window={size=1x1}, dim_labels=b01f_01io->b01f",
     "dim_labels name [4, 4, 4] dimensions where the input, kernel and result have [3, 3, 3]"),
    ("ROOT s = f32[4] slice(v), slice={[0:4:0]}", "slice [0:4:0] has a stride below 1"),
])
def test_products_convolutions_and_strides_that_xla_would_refuse(body, message):
    """XLA's own tests of malformed dot dimensions, convolution labels and windows, and a
    zero stride (an XLA test corpus probe): hlo-shard's report and optimize stopped on
    them with an internal error (exit 3) in the cost model; now each is a shape problem,
    which the command line refuses at its line and column."""
    text = ("HloModule m\nENTRY e { a = f32[2,3] parameter(0) b = f32[3,4] parameter(1) "
            "c = f32[3,2,5] parameter(2) b3 = f32[3,5,4] parameter(3) "
            "x = f32[1,2,1] parameter(4) k = f32[1,1,1] parameter(5) v = f32[4] parameter(6) "
            f"{body} }}\n")
    assert_only_problem(text, "shape", message)


@pytest.mark.parametrize("body, message", [
    ("t = (f32[8]) tuple(p) ROOT s = f32[8,3] broadcast(t), dimensions={0}",
     "a tuple where an array is expected"),
    ("ROOT s = (f32[8]) negate(p)", "a tuple where an array is expected"),
    ("ROOT s = f32[16] concatenate(p, p), dimensions={0,1}", "must name one dimension"),
])
def test_a_rule_meeting_the_wrong_kind_reports_it_instead_of_crashing(body, message):
    text = f"HloModule m\nENTRY e {{ p = f32[8] parameter(0) {body} }}\n"
    problems = validate(parse(text))
    assert [p.check for p in problems] == ["shape"] and message in problems[0].message


def test_an_instruction_built_without_its_index_is_reported():
    module = parse("HloModule m\nENTRY e { p = f32[8] parameter(0) t = (f32[8]) tuple(p)\n"
                   " ROOT x = f32[8] get-tuple-element(t), index=0 }\n")
    del module.entry.root.attributes["index"]
    assert "index= is missing" in str(validate(module)[0])


#: Computations the calling instructions below call: ``f`` takes two f32[4] and returns
#: one, ``body``/``cond`` read an (s32[], f32[4]) loop state, ``neg``/``wide`` are
#: branches, ``addb`` a bf16 reducer.
CALLEES = ADD + """
f { a = f32[4] parameter(0) b = f32[4] parameter(1) ROOT s = f32[4] add(a, b) }
body { ROOT p = (s32[], f32[4]) parameter(0) }
wide { p = (s32[], f32[4]) parameter(0) i = s32[] get-tuple-element(p), index=0 x = f32[4] get-tuple-element(p), index=1 y = f32[8] concatenate(x, x), dimensions={0} ROOT t = (s32[], f32[8]) tuple(i, y) }
cond { p = (s32[], f32[4]) parameter(0) ROOT t = pred[] constant(false) }
count { p = (s32[], f32[4]) parameter(0) ROOT i = s32[] get-tuple-element(p), index=0 }
neg { a = f32[4] parameter(0) ROOT n = f32[4] negate(a) }
twice { a = f32[4] parameter(0) ROOT n = f32[8] concatenate(a, a), dimensions={0} }
addb { x = bf16[] parameter(0) y = bf16[] parameter(1) ROOT r = bf16[] add(x, y) }
"""


@pytest.mark.parametrize("body, message", [
    ("ROOT c = f32[4] call(x, x), to_apply=f", None),
    ("ROOT c = f32[4] call(x), to_apply=f", "%f takes 2 parameters, given 1"),
    ("ROOT c = f32[4] call(x, w), to_apply=f", "parameter 1 of %f is f32[4], given f32[8]"),
    ("ROOT c = f32[8] call(x, x), to_apply=f", "%f returns f32[4], not f32[8]"),
    ("ROOT l = (s32[], f32[4]) while(t), condition=cond, body=body", None),
    ("ROOT l = (s32[], f32[4]) while(t), condition=cond, body=wide",
     "%wide returns (s32[], f32[8]), not (s32[], f32[4])"),
    ("ROOT l = (s32[], f32[4]) while(t), condition=count, body=body",
     "%count returns s32[], not pred[]"),
    ("ROOT l = (s32[], f32[8]) while(t), condition=cond, body=body",
     "the loop state (s32[], f32[4]) differs from the result"),
    ("ROOT c = f32[4] conditional(p, x, x), true_computation=neg, false_computation=neg", None),
    ("ROOT c = f32[4] conditional(p, x, x), true_computation=neg, false_computation=twice",
     "%twice returns f32[8], not f32[4]"),
    ("ROOT c = f32[4] conditional(i, x, x, x), branch_computations={neg, neg, neg}", None),
    ("ROOT c = f32[4] conditional(i, x, w), branch_computations={neg, neg}",
     "parameter 0 of %neg is f32[4], given f32[8]"),
    ("ROOT c = f32[4] conditional(z, x, x), branch_computations={neg, neg}",
     "the branch index is f32[], not pred[] or s32[]"),
    ("ROOT c = f32[4] fusion(x), kind=kLoop, calls=neg", None),
    ("ROOT c = f32[4] fusion(w), kind=kLoop, calls=neg", "parameter 0 of %neg is f32[4], given f32[8]"),
    ("ROOT r = f32[4] all-reduce(x), replica_groups={{0,1}}, to_apply=add", None),
    ("ROOT r = f32[4] all-reduce(x), replica_groups={{0,1}}, to_apply=addb", None),
    ("ROOT r = f32[] reduce(x, z), dimensions={0}, to_apply=addb",
     "%addb returns bf16[] for f32 values"),
])
def test_called_computations_take_the_operands_and_return_the_result(body, message):
    """A call, a loop, a conditional, a fusion and a reducer whose computation does not
    fit them: XLA refuses each when it compiles; optimize wrote them unchanged (exit 0)."""
    text = (f"HloModule m, replica_count=2\n{CALLEES}\nENTRY e {{ x = f32[4] parameter(0) "
            f"w = f32[8] parameter(1) p = pred[] parameter(2) i = s32[] parameter(3) "
            f"z = f32[] constant(0) n = s32[] constant(0) t = (s32[], f32[4]) tuple(n, x) "
            f"{body} }}\n")
    assert_only_problem(text, "shape", message)


@pytest.mark.parametrize("groups, message", [
    ("{{0,1},{2,3}}", None),
    ("{{0,1,2},{3}}", None),  # an all-reduce's groups may differ in size
    ("{{0,1}}", None),  # two of the four devices: XLA names 0..n-1 for the n named
    ("{{0,0}}", "a device appears in more than one group"),
    ("{{0,1},{3,2},{}}", "an empty group"),
    ("{{0,1},{3,4}}", "the groups name 4 devices but not device 2"),
])
def test_replica_groups_name_each_device_once_from_zero(groups, message):
    """XLA's ``CheckReplicaGroups``, whatever the header counts: optimize refused to
    write such an input "the optimized module fails validation" (exit 3, as if its own
    rewrite had slipped) where the module had no gradient, or wrote it unchanged."""
    text = (f"HloModule m, replica_count=4\n{ADD}\nENTRY e {{ x = f32[4] parameter(0) "
            f"ROOT r = f32[4] all-reduce(x), replica_groups={groups}, to_apply=add }}\n")
    assert_only_problem(text, "group-ids", message)


def test_groups_of_different_sizes_are_an_all_reduce_s_alone():
    text = (f"HloModule m, replica_count=4\n{ADD}\nENTRY e {{ x = f32[4] parameter(0) "
            f"ROOT r = f32[12] all-gather(x), replica_groups={{{{0,1,2}},{{3}}}}, "
            f"dimensions={{0}} }}\n")
    assert_only_problem(text, "group-ids", "groups have different sizes")


def test_a_loop_whose_body_changes_the_state_is_refused_at_its_line():
    from hlo_shard.errors import HloParseError
    from hlo_shard.validate import check_input

    text = (f"HloModule m\n{CALLEES}\nENTRY e {{ x = f32[4] parameter(0) "
            f"n = s32[] constant(0) t = (s32[], f32[4]) tuple(n, x)\n"
            f" ROOT l = (s32[], f32[4]) while(t), condition=cond, body=wide }}\n")
    with pytest.raises(HloParseError) as raised:
        check_input(parse(text), "loop.hlo")
    line = text.splitlines().index(" ROOT l = (s32[], f32[4]) while(t), condition=cond, "
                                   "body=wide }") + 1
    assert str(raised.value) == (f"loop.hlo:{line}:7: error: %l: %wide returns "
                                 "(s32[], f32[8]), not (s32[], f32[4]) (shape)")
