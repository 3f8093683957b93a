"""The user's names (pytree paths from entry parameters' ``op_name``) in ``optimize
--explain``/``--json``, ``report``, ``diff`` and the manifest; modules without them print
as before; hostile ``op_name`` never breaks anything."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from hlo_shard.analysis.names import (MAX_NAME, UserNames, as_path, op_name, parameter_names,
                                      user_names)
from hlo_shard.cli import main
from hlo_shard.parser import parse
from hlo_shard.runtime.manifest import parse_manifest

from test_pass_weight_update import FACTORED

ADAM = Path(__file__).parent.parent / "fixtures" / "spmd" / "adam.n2.hlo"

#: ``optimize --force --state sharded --explain``'s table on adam.n2: each gradient named
#: by the weight it updates; the scalar loss all-reduce has no weight.
NAMED_TABLE = """\
all-reduce                                    shape            bytes  sharded  ops moved  copies  saved flops  collective / reason
main.12_spmd/psum.35 (gradient of p['l0_b'])  f32[13]{0}       52     yes      25         0       162          reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.36 (gradient of p['l0_w'])  f32[12,13]{0,1}  624    yes      25         3       1.95e+03     reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.37 (gradient of p['l1_b'])  f32[10]{0}       40     yes      25         0       125          reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.38 (gradient of p['l1_w'])  f32[13,10]{0,1}  520    yes      25         3       1.62e+03     reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.39                          f32[]            4      no       0          0       0            scalar: nothing to shard"""

#: The same module without parameter metadata: the table as it always was.
PLAIN_TABLE = """\
all-reduce            shape            bytes  sharded  ops moved  copies  saved flops  collective / reason
main.12_spmd/psum.35  f32[13]{0}       52     yes      25         0       162          reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.36  f32[12,13]{0,1}  624    yes      25         3       1.95e+03     reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.37  f32[10]{0}       40     yes      25         0       125          reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.38  f32[13,10]{0,1}  520    yes      25         3       1.62e+03     reduce-scatter.1 (combined, 4 tensors)
main.12_spmd/psum.39  f32[]            4      no       0          0       0            scalar: nothing to shard"""


def without_parameter_metadata(text: str) -> str:
    return re.sub(r"(parameter\(\d+\)[^\n]*?), metadata=\{[^}\n]*\}", r"\1", text)


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """adam.n2 with and without parameter names, each optimized (forced, state sharded)
    with its --explain, --json and manifest."""
    folder = tmp_path_factory.mktemp("names")
    out = {}
    for kind, text in (("named", ADAM.read_text()),
                       ("plain", without_parameter_metadata(ADAM.read_text()))):
        source, optimized = folder / f"{kind}.hlo", folder / f"{kind}.opt.hlo"
        manifest = folder / f"{kind}.json"
        source.write_text(text)
        result = CliRunner().invoke(main, [
            "optimize", str(source), "-o", str(optimized), "--force", "--state", "sharded",
            "--explain", "--json", "--manifest", str(manifest)])
        assert result.exit_code == 0, result.output
        out[kind] = {"source": source, "optimized": optimized, "stderr": result.stderr,
                     "json": json.loads(result.stdout),
                     "manifest": json.loads(manifest.read_text())}
    return out


def invoke(*args: str):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_parameter_names_are_the_pytree_paths_jax_wrote():
    names = parameter_names(parse(ADAM.read_text()))
    assert names[1] == "p['l0_w']" and names[4] == "s[0].count"
    assert names[5] == "s[0].mu['l0_b']" and names[13] == "b['x']"
    assert len(names) == 15


def test_explain_names_each_gradient_by_its_weight(modules):
    table = "\n".join(modules["named"]["stderr"].splitlines()[:6])
    assert table == NAMED_TABLE


def test_a_module_without_names_explains_as_before(modules):
    plain = modules["plain"]
    assert "\n".join(plain["stderr"].splitlines()[:6]) == PLAIN_TABLE
    assert all("gradient_of" not in row for row in plain["json"]["explanations"])
    records = plain["manifest"]["parameters"] + plain["manifest"]["outputs"]
    assert all("user_name" not in r for r in records)
    report = json.loads(invoke("report", str(plain["source"]), "--json"))
    assert "parameter_names" not in report
    assert all("name" not in row for row in report["weights"].values())


def test_json_rows_say_whose_gradient_they_are(modules):
    rows = modules["named"]["json"]["explanations"]
    assert [r["gradient_of"] for r in rows] == ["p['l0_b']", "p['l0_w']", "p['l1_b']",
                                                "p['l1_w']", None]


def test_manifest_records_carry_the_user_name_and_read_back(modules, tmp_path):
    data = modules["named"]["manifest"]
    by_index = {r["index"]: r for r in data["parameters"]}
    assert by_index[1]["user_name"] == "p['l0_w']" and by_index[1]["name"] == "param.16"
    sharded = [r for r in data["parameters"] if r["kind"] == "sharded"]
    assert {r["user_name"] for r in sharded} == {
        f"s[0].{m}['{w}']" for m in ("mu", "nu") for w in ("l0_b", "l0_w", "l1_b", "l1_w")}
    outputs = {r["index"]: r for r in data["outputs"]}
    assert outputs[1]["user_name"] == "p['l0_w']"  # the next value of parameter 1
    manifest = parse_manifest(data)
    assert manifest.parameter(1).user_name == "p['l0_w']"
    assert manifest.parameter(1).label == "param.16 (p['l0_w'])"
    # Manifests written before names existed read as before.
    for record in data["parameters"] + data["outputs"]:
        record.pop("user_name", None)
    assert parse_manifest(data).parameter(1).user_name == ""


def test_report_names_each_weight(modules):
    source = str(modules["named"]["source"])
    text = invoke("report", source)
    assert "param.16 (p['l0_w'])" in text
    data = json.loads(invoke("report", source, "--json"))
    assert data["weights"]["param.16"]["name"] == "p['l0_w']"
    plain = json.loads(invoke("report", str(modules["plain"]["source"]), "--json"))
    assert {k: {f: v for f, v in row.items() if f != "name"}
            for k, row in data["weights"].items()} == plain["weights"]


def test_diff_names_each_weight(modules):
    named = modules["named"]
    text = invoke("diff", str(named["source"]), str(named["optimized"]))
    assert "param.16 (p['l0_w']): update time" in text
    data = json.loads(invoke("diff", str(named["source"]), str(named["optimized"]),
                             "--json"))
    assert data["after"]["weights"]["param.16"]["name"] == "p['l0_w']"
    plain = modules["plain"]
    assert "(p[" not in invoke("diff", str(plain["source"]), str(plain["optimized"]))


#: FACTORED with names, stored column-major: the weight, its factored statistic (kept
#: whole, with a note: the row statistic sums along the blocks the devices hold).
NAMED_FACTORED = FACTORED.replace("f32[8,16]", "f32[8,16]{0,1}").replace(
    "w = f32[8,16]{0,1} parameter(0)",
    "w = f32[8,16]{0,1} parameter(0), metadata={op_name=\"p['w']\"}"
).replace("r = f32[8] parameter(1)",
          "r = f32[8] parameter(1), metadata={op_name=\"s[0].v_row[\\'w\\']\"}")


def test_kept_whole_state_notes_name_the_state_leaf(tmp_path):
    source = tmp_path / "f.hlo"
    source.write_text(NAMED_FACTORED)
    result = CliRunner().invoke(main, ["optimize", str(source), "-o", str(tmp_path / "o.hlo"),
                                       "--force", "--state", "sharded", "--explain", "--json"])
    assert result.exit_code == 0, result.output
    (note,) = [n for n in json.loads(result.stdout)["notes"] if "parameter 1 " in n]
    assert note.startswith("optimizer state parameter 1 (%r f32[8], s[0].v_row['w']) "
                           "stays whole")
    assert f"note: {note}" in result.stderr


@pytest.mark.parametrize("raw, name", [
    (r'"p[\'l0_w\']"', "p['l0_w']"),
    (r'"s[0].mu[\'l0\'][\'w\']"', "s[0].mu['l0']['w']"),
    (r'"params.layers[3].kernel"', "params.layers[3].kernel"),
    (r'"x"', "x"),
    (r'"p[\'w\303\251\']"', "p['wé']"),             # absl::CEscape's UTF-8 bytes
    ('"p[\'wé\']"', "p['wé']"),                     # raw UTF-8
    (r'"p[\"a]b\"]"', 'p["a]b"]'),                  # a quote and bracket inside the key
    (r'"jit(step)/shard_map/dot_general"', None),   # an instruction's call stack
    (r'"transpose(jvp())/reduce_sum"', None),
    (r'"p[\'a\']\nrm -rf"', None),                   # a newline: never printed
    (r'"p[\'unclosed"', None),
    (r'"p[\'a\'] extra"', None),
    (r'""', None),
    ('"' + "a" * (MAX_NAME + 1) + '"', None),        # too long to show
])
def test_op_name_reads_as_a_path_or_not_at_all(raw, name):
    module = parse(f"HloModule m\nENTRY e {{ ROOT p = f32[] parameter(0), "
                   f"metadata={{op_name={raw}}} }}\n")
    assert as_path(op_name(module.entry.root)) == name
    assert parameter_names(module) == ({0: name} if name else {})


def test_op_name_inside_another_field_is_not_taken():
    module = parse('HloModule m\nENTRY e { ROOT p = f32[] parameter(0), '
                   'metadata={op_type="op_name=\\"p\\"" source_line=3} }\n')
    assert op_name(module.entry.root) is None


def test_hostile_names_pass_through_every_output(tmp_path):
    """Quotes, brackets, unicode and a 200-character name: every command still works and
    prints them as they are; the module itself is unchanged by naming."""
    long_name = "p['" + "é" * (MAX_NAME - 5) + "']"
    text = ADAM.read_text().replace(
        "op_name=\"p[\\'l0_w\\']\"", "op_name=\"p[\\'\\\"]) ,}\\']\"").replace(
        "op_name=\"p[\\'l1_w\\']\"", f"op_name=\"{long_name.replace(chr(39), chr(92) + chr(39))}\"")
    names = parameter_names(parse(text))
    assert names[1] == "p['\"]) ,}']" and names[3] == long_name
    source = tmp_path / "h.hlo"
    source.write_text(text)
    out = tmp_path / "o.hlo"
    result = CliRunner().invoke(main, ["optimize", str(source), "-o", str(out), "--force",
                                       "--explain", "--json", "--manifest",
                                       str(tmp_path / "m.json")])
    assert result.exit_code == 0, result.output
    assert f"(gradient of {long_name})" in result.stderr
    rows = json.loads(result.stdout)["explanations"]
    assert rows[1]["gradient_of"] == "p['\"]) ,}']"
    manifest = parse_manifest(json.loads((tmp_path / "m.json").read_text()))
    assert manifest.parameter(3).user_name == long_name
    assert long_name in invoke("report", str(source))
    assert long_name in invoke("diff", str(source), str(out))


def test_override_names_win_and_need_no_metadata():
    module = parse(without_parameter_metadata(ADAM.read_text()))
    assert not user_names(module)
    names = user_names(module, override={1: "params['l0']['w']"})
    assert names.parameters == {1: "params['l0']['w']"}
    assert names.gradient_of("main.12_spmd", "psum.36", None) == "params['l0']['w']"
    assert not UserNames() and UserNames().note("optimizer state parameter 1 (%r f32[8])") \
        == "optimizer state parameter 1 (%r f32[8])"


FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("fixture", ["spmd/clip_adam.n2", "spmd/transformer.n2",
                                     "optimized/adam.n4", "replica/adam.n4",
                                     "spmd/loop_adam.n2", "spmd/momentum.n2",
                                     "optimized/sgd.n4"])
def test_every_gradient_is_named_by_its_own_weight(fixture):
    """Global-norm clipping couples every gradient to every update, XLA's combiner puts
    them in one tuple all-reduce, shard_map returns one tuple, a training loop carries the
    weights in a while body, a step without donation has no input_output_alias to pair
    parameters with their next values (momentum, sgd): each array gradient is
    still the gradient of exactly one weight (``p[...]``, never its optimizer state), of
    its shape, a different one each."""
    module = parse((FIXTURES / f"{fixture}.hlo").read_text())
    names = user_names(module)
    params = {p.parameter_number: p for p in module.entry.parameters()}
    leaves = []
    for comp, inst in ((c, i) for c in module.computations for i in c.instructions):
        if inst.opcode == "all-reduce":
            shapes = getattr(inst.shape, "elements", None) or [inst.shape]
            leaves += [((comp.name, inst.name, None if len(shapes) == 1 and
                         shapes[0] is inst.shape else i), shape)
                       for i, shape in enumerate(shapes)]
    weights = []
    for key, shape in leaves:
        if shape.num_elements <= 1:
            continue
        weight = names.gradients[key]
        assert names.parameters[weight].startswith("p[")
        assert sorted(params[weight].shape.dims) == sorted(shape.dims)
        weights.append(weight)
    assert weights and len(set(weights)) == len(weights)


@pytest.mark.parametrize("metadata, written", [
    (None, '{op_name="model.a[\'k\']"}'),
    ('{op_name="model.states[0][3]" source_line=7}',
     '{op_name="model.a[\'k\']" source_line=7}'),
    ('{source_file="step.py" source_line=7}',
     '{op_name="model.a[\'k\']" source_file="step.py" source_line=7}')])
def test_with_op_name_writes_the_name_and_keeps_the_other_fields(metadata, written):
    """What ``per_device_hlo`` writes into a wrapper's entry parameter: the user's path
    as ``op_name`` (replaced, or added first), read back the same by ``op_name``."""
    from hlo_shard.analysis.names import op_name, with_op_name
    from hlo_shard.ir import Instruction, Raw

    param = Instruction("p", "parameter", None, [], {} if metadata is None else
                        {"metadata": Raw(metadata)}, 0)
    value = with_op_name(param, "model.a['k']")
    assert value.text == written
    param.attributes["metadata"] = value
    assert op_name(param) == "model.a['k']"
    param.attributes["metadata"] = with_op_name(param, 'q"\\\n')
    assert op_name(param) == 'q"\\\n'
