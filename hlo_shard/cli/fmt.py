"""``hlo-shard fmt``: parse HLO text and print it back in hlo-shard's canonical form."""

from __future__ import annotations

import click

from hlo_shard.cli.app import check_output_path, main, read_text, user_errors, write_output


@main.command()
@click.argument("input_path", metavar="IN.hlo", type=click.Path(dir_okay=False))
@click.option("-o", "--output", metavar="OUT.hlo", default=None,
              help="Where to write the result; '-' or absent: standard output.")
@user_errors
def fmt(input_path: str, output: str | None) -> None:
    """Normalise IN.hlo: long form, % names, result shapes, callees first."""
    from hlo_shard.parser import parse
    from hlo_shard.printer import to_text

    check_output_path(output, [input_path])
    write_output(output, to_text(parse(read_text(input_path), input_path)))
