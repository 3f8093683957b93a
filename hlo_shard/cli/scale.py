"""``hlo-shard scale``: projected step time and memory from 8 to 1024 replicas.

The pass is re-run on the module retargeted to each replica count (see
:mod:`hlo_shard.scaling`); both modules are then estimated on the profile.
Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from hlo_shard import limits
from hlo_shard.cli.app import (check_distinct_outputs, check_output_path, main, step_input,
                               user_errors, write_outputs)
from hlo_shard.cli.report import load_module, manifest_option, manifest_roles
from hlo_shard.errors import HloShardError
from hlo_shard.profiles import ALGORITHMS, available_profiles

if TYPE_CHECKING:
    from hlo_shard.ir import Module


def _replica_list(text: str, max_replicas: str | None) -> list[int]:
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise HloShardError(f"--replicas expects numbers like 8,16,32, not {text!r}") from None
    if not values:
        raise HloShardError("--replicas is empty")
    limits.REPLICAS.check(max(values), "--replicas", max_replicas)
    return sorted(set(values))  # (one row per count, in order)


def _batch_mode(text: str) -> int | None:
    """``fixed`` (weak scaling) → None; ``global=B`` → B examples shared by all replicas."""
    if text == "fixed":
        return None
    if text.startswith("global="):
        try:
            value = int(text.split("=", 1)[1])
        except ValueError:
            value = 0
        if value > 0:
            return value
    raise HloShardError(f"--batch-per-replica must be 'fixed' or 'global=B', not {text!r}")


_SUFFIXES = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "B": 10 ** 9}


def _parameter_count(text: str | None) -> int | None:
    """``210M`` → 210000000; None when not given."""
    if text is None:
        return None
    text = text.strip()
    number, suffix = (text, "") if text[-1:].isdigit() else (text[:-1], text[-1:].upper())
    try:
        value = float(number) * _SUFFIXES[suffix]
    except (KeyError, ValueError):
        value = 0
    if value < 1:
        raise HloShardError(f"--parameters expects a count like 210M, not {text!r}")
    return int(value)


def _refuse_sharded(module: Module, path: str) -> None:
    """A module the pass already rewrote has nothing left to project ("saving 0.0%")."""
    from hlo_shard.analysis.collectives import find_gradient_all_reduces

    shardable = [ar for ar in find_gradient_all_reduces(module) if ar.is_candidate
                 and module.computation(ar.computation)[ar.name].shape.byte_size > 4]
    scattered = any(i.opcode == "reduce-scatter" for c in module.computations
                    for i in c.instructions)
    if scattered and not shardable:
        raise HloShardError(f"{path} is already weight-update sharded (reduce-scatter, no "
                            "gradient all-reduce left): scale projects the original module, "
                            "the one optimize was given")


@main.command()
@click.argument("module_path", metavar="IN.hlo|DUMP_DIR", type=click.Path())
@click.option("--replicas", default="8,16,32,64,128,256,512,1024", show_default=True,
              metavar="N,N,…", help="Replica counts to project to.")
@click.option("--profile", default="tpu-v3", show_default=True, metavar="NAME|FILE",
              help=f"Hardware profile: {', '.join(available_profiles())}, or a JSON file.")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), default=None,
              help="Collective algorithm (default: the profile's).")
@click.option("--batch-per-replica", "batch_mode", default="fixed", show_default=True,
              metavar="fixed|global=B",
              help="fixed: weak scaling. global=B: B examples per step shared by all "
                   "replicas (strong scaling; forward/backward scaled analytically).")
@click.option("--parameters", "parameters", default=None, metavar="P",
              help="Project a model of P weights (e.g. 210M) of the same shape, scaled "
                   "analytically from the module's own; its tensor widths (and padding) "
                   "stay the module's (see docs/cost-model.md).")
@click.option("--state", type=click.Choice(["gathered", "sharded"]), default="sharded",
              show_default=True, help="Optimizer state of the sharded module.")
@click.option("--strategy", type=click.Choice(["auto", "per-tensor", "combined"]),
              default="auto", show_default=True, help="The pass's collective strategy.")
@manifest_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")
@click.option("--markdown", is_flag=True, help="Markdown instead of a text table.")
@click.option("--plot", "plot_path", metavar="FILE.png", default=None,
              type=click.Path(dir_okay=False), help="Write the scaling curve as a PNG.")
@click.option("--html", "html_path", metavar="FILE", default=None,
              type=click.Path(dir_okay=False), help="Write a self-contained HTML page.")
@click.option("-o", "--output", metavar="FILE", default=None, type=click.Path(dir_okay=False),
              help="Write the table/JSON here instead of stdout.")
@click.option("--max-replicas", metavar="N", default=None,
              help=f"Refuse replica counts above this (default {limits.REPLICAS.default}, "
                   f"or {limits.REPLICAS.env}).")
@user_errors
def scale(module_path: str, replicas: str, profile: str, algorithm: str | None, batch_mode: str,
          parameters: str | None, state: str, strategy: str, manifest_path: str | None,
          as_json: bool, markdown: bool, plot_path: str | None, html_path: str | None,
          output: str | None, max_replicas: str | None) -> None:
    """Project the step time and peak memory of IN.hlo (the original, unsharded
    module) and of its weight-update-sharded form across replica counts."""
    from hlo_shard.profiles import load_profile
    from hlo_shard.reports.content import scale_document, scale_json
    from hlo_shard.reports.render import (figure_png, render_html, render_markdown,
                                          render_text, to_json_text)
    from hlo_shard.scaling import project

    counts = _replica_list(replicas, max_replicas)
    global_batch = _batch_mode(batch_mode)
    if global_batch is not None and global_batch < max(counts):
        raise HloShardError(f"--batch-per-replica global={global_batch} is smaller than "
                            f"{max(counts)} replicas: each would get less than one example")
    parameter_count = _parameter_count(parameters)
    if as_json and markdown:
        raise HloShardError("--json and --markdown are exclusive")
    module_path, picked = step_input(module_path)
    for target in (output, plot_path, html_path):
        check_output_path(target, [module_path])
    check_distinct_outputs({"-o": output, "--plot": plot_path, "--html": html_path})
    module = load_module(module_path)
    _refuse_sharded(module, module_path)
    hardware = load_profile(profile)
    points = project(module, counts, hardware, global_batch=global_batch, state=state,
                     strategy=strategy, algorithm=algorithm, parameters=parameter_count,
                     roles=manifest_roles(manifest_path, [module_path])[0])
    document = scale_document(module_path, hardware, points, batch_mode, state, parameter_count)
    png = figure_png(document.figures[0]) if plot_path is not None else None
    html = render_html(document) if html_path is not None else None
    text = (to_json_text(scale_json(module_path, hardware, points, batch_mode, state,
                                    parameter_count))
            if as_json else render_markdown(document) if markdown else render_text(document))
    write_outputs([(plot_path, png), (html_path, html), (output, text)])
    if picked:
        click.echo(picked, err=True)
