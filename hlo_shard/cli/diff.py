"""``hlo-shard diff``: two modules' cost reports side by side, with deltas.

Typically the original module and its ``optimize`` output: per row (step time by
category, flops, bytes, peak memory by category), per collective kind and per weight
tensor, the absolute and relative change. Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

import click

from hlo_shard.cli.app import main, step_input, user_errors
from hlo_shard.cli.report import emit, load_module, manifest_roles, module_profile, report_options


@main.command()
@click.argument("before_path", metavar="BEFORE.hlo|DUMP_DIR", type=click.Path())
@click.argument("after_path", metavar="AFTER.hlo|DUMP_DIR", type=click.Path())
@report_options
@user_errors
def diff(before_path: str, after_path: str, profile: str | None, algorithm: str | None,
         manifest_path: str | None, as_json: bool, markdown: bool, html_path: str | None,
         output: str | None) -> None:
    """Compare the estimated cost of BEFORE.hlo and AFTER.hlo per device."""
    from hlo_shard.passes.weight_update import planned_update_regions
    from hlo_shard.costmodel.step_time import estimate_step
    from hlo_shard.reports.content import diff_document, diff_json

    (before_path, picked_before), (after_path, picked_after) = map(step_input,
                                                                  (before_path, after_path))
    before, after = load_module(before_path), load_module(after_path)
    hardware = module_profile(profile, before)
    a, b = (estimate_step(module, hardware, planned_update_regions(module), algorithm=algorithm,
                          roles=roles)
            for module, roles in zip((before, after),
                                     manifest_roles(manifest_path, [before_path, after_path])))
    data = diff_json(a, b, before, after)
    emit(diff_document(a, b, before, after, (data["before"]["weights"], data["after"]["weights"])),
         data, as_json=as_json, markdown=markdown, html_path=html_path, output=output,
         inputs=[before_path, after_path])
    for picked in (picked_before, picked_after):
        if picked:
            click.echo(picked, err=True)
