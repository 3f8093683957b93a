"""``hlo-shard optimize DUMP_DIR`` (and report, diff, scale, verify): the per-device
stage of the largest step in a real XLA dump folder, or one line saying which flags
write it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from jax_train_helpers import make_program, needs_devices

from hlo_shard import runtime
from hlo_shard.cli import main


def test_optimize_reads_the_partitioned_step_of_a_dump_folder(request, tmp_path):
    if not needs_devices(request):
        return
    program = make_program("mlp", "adam", 2)
    params, opt_state = program.init()
    dump = tmp_path / "dump"
    options = {"xla_dump_to": str(dump), "xla_dump_large_constants": True,
               "xla_dump_hlo_pass_re": "spmd-partitioning|call-inliner"}
    program.step.lower(params, opt_state, program.batch(0)).compile(compiler_options=options)
    out = tmp_path / "step.hlo"
    result = CliRunner().invoke(main, ["optimize", str(dump), "-o", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert "after_call-inliner.before_pipeline-end.txt" in result.output  # says which file
    assert "reduce-scatter" in out.read_text()
    # every command that reads a step reads the same file of the folder, and says so
    try:
        for command in (["report", str(dump)], ["diff", str(dump), str(out)],
                        ["scale", str(dump), "--replicas", "2,4"],
                        ["verify", str(dump), str(out), "--steps", "2"]):
            result = CliRunner().invoke(main, command)
            assert result.exit_code == 0, (command, result.output)
            assert f"read {dump}'s training step: " in result.output, command
            assert "MATCH" in result.output or command[0] != "verify"
    finally:  # (verify's worker, in this process here: a later test counts its threads)
        runtime.shutdown_workers()


@pytest.mark.parametrize("command", [["optimize", "{dir}", "-o", "{dir}/o"], ["report", "{dir}"],
                                     ["scale", "{dir}"], ["diff", "{dir}", "{dir}"],
                                     ["verify", "{dir}"]])
def test_a_folder_without_the_stage_is_one_line_naming_the_flags(tmp_path, command):
    (tmp_path / "module_0001.jit_step.cpu_after_optimizations.txt").write_text("HloModule x\n")
    args = [a.format(dir=tmp_path) for a in command]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and "--xla_dump_hlo_pass_re=spmd-partitioning|call-inliner" in line
    assert "jit_step" in line and not (tmp_path / "o").exists()
