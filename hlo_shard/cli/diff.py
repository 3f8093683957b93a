"""``hlo-shard diff``: two modules' cost reports side by side, with deltas.

Typically the original module and its ``optimize`` output: per row (step time by
category, flops, bytes, peak memory by category), per collective kind and per weight
tensor, the absolute and relative change. Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

import click

from hlo_shard.cli.app import main, user_errors
from hlo_shard.cli.report import emit, load_module, report_options


@main.command()
@click.argument("before_path", metavar="BEFORE.hlo", type=click.Path(dir_okay=False))
@click.argument("after_path", metavar="AFTER.hlo", type=click.Path(dir_okay=False))
@report_options
@user_errors
def diff(before_path: str, after_path: str, profile: str, algorithm: str | None, as_json: bool,
         markdown: bool, html_path: str | None, output: str | None) -> None:
    """Compare the estimated cost of BEFORE.hlo and AFTER.hlo per device."""
    from hlo_shard.reports import content as fmt
    from hlo_shard.costmodel.step_time import estimate_step

    hardware = fmt.resolve_profile(profile)
    before, after = load_module(before_path), load_module(after_path)
    a = estimate_step(before, hardware, algorithm=algorithm)
    b = estimate_step(after, hardware, algorithm=algorithm)
    emit(fmt.diff_document(a, b, before, after), fmt.diff_json(a, b, before, after),
         as_json=as_json, markdown=markdown, html_path=html_path, output=output,
         inputs=[before_path, after_path])
