"""``hlo-shard report``: estimated step time, memory and traffic of one module.

Figures are per device, from hlo-shard's cost model on a hardware profile (XLA's
cost-analysis rules for flops and bytes, an α-β model for collectives, a roofline
per kernel, buffer liveness for memory). Exit status 0, or 2 on bad input.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from hlo_shard.cli.app import (check_distinct_outputs, check_output_path, main, read_text,
                               user_errors, write_outputs)
from hlo_shard.errors import HloShardError
from hlo_shard.ir import Module
from hlo_shard.profiles import ALGORITHMS, DEFAULT_PROFILE, available_profiles


def report_options(command: Callable) -> Callable:
    """Options shared by ``report`` and ``diff``."""
    decorators = [
        click.option("--profile", default=DEFAULT_PROFILE, show_default=True, metavar="NAME|FILE",
                     help=f"Hardware profile: {', '.join(available_profiles())}, or a JSON file."),
        click.option("--algorithm", type=click.Choice(ALGORITHMS), default=None,
                     help="Collective algorithm (default: the profile's)."),
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


def load_module(path: str) -> Module:
    from hlo_shard.parser import parse

    return parse(read_text(path), path=path)


def emit(document, data: dict, *, as_json: bool, markdown: bool, html_path: str | None,
         output: str | None, inputs: list[str]) -> None:
    """Write the report in the chosen format(s)."""
    from hlo_shard.reports import content as fmt

    if as_json and markdown:
        raise HloShardError("--json and --markdown are exclusive")
    for target in (output, html_path):
        check_output_path(target, inputs)
    check_distinct_outputs({"-o": output, "--html": html_path})
    html = fmt.render_html(document) if html_path is not None else None
    text = (fmt.to_json_text(data) if as_json else fmt.render_markdown(document) if markdown
            else fmt.render_text(document))
    write_outputs([(html_path, html), (output, text)])


@main.command()
@click.argument("module_path", metavar="IN.hlo", type=click.Path(dir_okay=False))
@report_options
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Instructions listed by estimated time.")
@user_errors
def report(module_path: str, profile: str, algorithm: str | None, as_json: bool, markdown: bool,
           html_path: str | None, output: str | None, top: int) -> None:
    """Estimated cost of one step of IN.hlo per device: step time split into
    forward/backward, weight update, communication and formatting; collectives by
    kind; peak memory by category; the most expensive instructions."""
    from hlo_shard.reports import content as fmt
    from hlo_shard.costmodel.step_time import estimate_step

    module = load_module(module_path)
    est = estimate_step(module, fmt.resolve_profile(profile), algorithm=algorithm)
    emit(fmt.report_document(est, module, top), fmt.report_json(est, module, top),
         as_json=as_json, markdown=markdown, html_path=html_path, output=output,
         inputs=[module_path])
