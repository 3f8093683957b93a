"""``hlo-shard report``: estimated step time, memory and traffic of one module.

Figures are per device, from hlo-shard's cost model on a hardware profile (XLA's
cost-analysis rules for flops and bytes, an α-β model for collectives, a roofline
per kernel, buffer liveness for memory). Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from hlo_shard.cli.app import (check_distinct_outputs, check_output_path, main, read_text,
                               step_input, user_errors, write_outputs)
from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module
from hlo_shard.profiles import ALGORITHMS, DEFAULT_PROFILE, HardwareProfile, available_profiles
from hlo_shard.reports.document import Document
from hlo_shard.schema import load_json

#: Roles in a fixtures manifest (``make fixtures``'s ``MANIFEST.json``) → parameter kinds.
_MANIFEST_ROLES = {"weight": "weights", "optimizer_state": "optimizer_state", "batch": "batch"}

manifest_option = click.option(
    "--fixtures-manifest", "manifest_path", metavar="MANIFEST.json", default=None,
    type=click.Path(dir_okay=False),
    help="Take the roles of the entry parameters (weights, optimizer state, batch) from a "
         "fixtures manifest (make fixtures), keyed FOLDER/FILE.hlo, instead of inferring "
         "them (an input it has no entry for is inferred; it must describe one).")


def report_options(command: Callable) -> Callable:
    """Options shared by ``report`` and ``diff``."""
    decorators = [
        click.option("--profile", default=None, metavar="NAME|FILE",
                     help=f"Hardware profile: {', '.join(available_profiles())}, or a JSON file. "
                          f"Default: the accelerator's profile where the module's custom-calls "
                          f"name one, else {DEFAULT_PROFILE}."),
        click.option("--algorithm", type=click.Choice(ALGORITHMS), default=None,
                     help="Collective algorithm (default: the profile's)."),
        manifest_option,
        click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON."),
        click.option("--markdown", is_flag=True, help="Markdown instead of a text table."),
        click.option("--html", "html_path", metavar="FILE", default=None,
                     type=click.Path(dir_okay=False),
                     help="Also write a self-contained HTML page with plots."),
        click.option("-o", "--output", metavar="FILE", default=None,
                     type=click.Path(dir_okay=False),
                     help="Write the text/Markdown/JSON report here instead of stdout."),
    ]
    for decorator in reversed(decorators):
        command = decorator(command)
    return command


def module_profile(profile: str | None, module: Module) -> HardwareProfile:
    """``--profile``, or the one the module's platform calls for (a note on stderr says
    which, or that the default prices an accelerator's program)."""
    from hlo_shard.profiles.detect import profile_for_module

    hardware, note = profile_for_module(profile, module)
    if note is not None:
        click.echo(f"note: {note}", err=True)
    return hardware


def load_module(path: str) -> Module:
    """The module of ``path``, refused where it is no module XLA would compile."""
    from hlo_shard.parser import parse
    from hlo_shard.validate import check_input

    module = parse(read_text(path), path=path)
    check_input(module, path)
    return module


def manifest_roles(manifest_path: str | None, module_paths: list[str]
                   ) -> list[dict[int, str] | None]:
    """Per input, entry parameter number → kind from the fixtures manifest given with
    ``--fixtures-manifest``: its entry keyed ``<folder>/<file>`` (as ``make fixtures``
    writes them), or None (inferred) for an input it has no entry for — ``diff`` of a
    fixture and its optimized copy. A manifest that describes no input is an error."""
    if manifest_path is None:
        return [None] * len(module_paths)
    manifest = load_json(manifest_path, "fixtures manifest")
    keys = [f"{Path(p).parent.name}/{Path(p).name}" for p in module_paths]
    entries = [manifest.get(key) if isinstance(manifest, dict) else None for key in keys]
    roles = [{p["index"]: _MANIFEST_ROLES.get(str(p.get("role")), "other_parameters")
              for p in entry["parameters"]
              if isinstance(p, dict) and isinstance(p.get("index"), int)}
             if isinstance(entry, dict) and isinstance(entry.get("parameters"), list) else None
             for entry in entries]
    if all(r is None for r in roles):
        raise HloShardError(f"fixtures manifest {manifest_path}: no entry "
                            f"{' or '.join(map(repr, keys))} listing its parameters")
    return roles


def emit(document: Document, data: dict, *, as_json: bool, markdown: bool, html_path: str | None,
         output: str | None, inputs: list[str]) -> None:
    """Write the report in the chosen format(s)."""
    from hlo_shard.reports.render import render_html, render_markdown, render_text, to_json_text

    if as_json and markdown:
        raise HloShardError("--json and --markdown are exclusive")
    for target in (output, html_path):
        check_output_path(target, inputs)
    check_distinct_outputs({"-o": output, "--html": html_path})
    html = render_html(document) if html_path is not None else None
    text = (to_json_text(data) if as_json else render_markdown(document) if markdown
            else render_text(document))
    write_outputs([(html_path, html), (output, text)])


@main.command()
@click.argument("module_path", metavar="IN.hlo|DUMP_DIR", type=click.Path())
@report_options
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Instructions listed by estimated time.")
@user_errors
def report(module_path: str, profile: str | None, algorithm: str | None, manifest_path: str | None,
           as_json: bool, markdown: bool, html_path: str | None, output: str | None,
           top: int) -> None:
    """Estimated cost of one step of IN.hlo per device: step time split into
    forward/backward, weight update, communication and formatting; collectives by
    kind; peak memory by category; the most expensive instructions."""
    from hlo_shard.passes.weight_update import planned_update_regions
    from hlo_shard.costmodel.step_time import estimate_step
    from hlo_shard.reports.content import report_document, report_json

    module_path, picked = step_input(module_path)
    module = load_module(module_path)
    est = estimate_step(module, module_profile(profile, module), planned_update_regions(module),
                        algorithm=algorithm, roles=manifest_roles(manifest_path, [module_path])[0])
    data = report_json(est, module, top)
    emit(report_document(est, module, top, data["weights"]), data, as_json=as_json,
         markdown=markdown, html_path=html_path, output=output, inputs=[module_path])
    if picked:
        click.echo(picked, err=True)
    from hlo_shard.runtime.forms import global_program_mark

    if mark := global_program_mark(module):
        click.echo(f"note: this is the global program before SPMD partitioning ({mark}): "
                   "its figures are the whole program's, not a device's; report the "
                   "per-device module (hlo_shard.jax.per_device_hlo, or the "
                   "*.spmd-partitioner.after_call-inliner… dump)", err=True)
