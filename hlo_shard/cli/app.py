"""The click group and the helpers every command shares."""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

import click

from hlo_shard.errors import HloParseError, HloShardError
from hlo_shard.source import read_text  # noqa: F401 - re-exported for the commands

EXIT_USAGE = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hlo-shard")
def main() -> None:
    """Automatic cross-replica sharding of the weight update for XLA HLO text."""


def fail(message: str) -> "NoReturn":  # noqa: F821 - typing only
    """Print one error line and exit with the usage/input status."""
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def user_errors(command: Callable) -> Callable:
    """Turn every anticipated failure into a clean message and exit status 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except HloParseError as err:
            click.echo(err.render(), err=True)
            sys.exit(EXIT_USAGE)
        except HloShardError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(EXIT_USAGE)
        except RecursionError:
            click.echo("error: input nests too deeply to process", err=True)
            sys.exit(EXIT_USAGE)
        except MemoryError:
            click.echo("error: out of memory while processing the input", err=True)
            sys.exit(EXIT_USAGE)
        except OSError as err:
            where = f"{err.filename}: " if err.filename else ""
            click.echo(f"error: {where}{err.strerror or err}", err=True)
            sys.exit(EXIT_USAGE)

    return wrapper


def check_output_path(output: str | None, inputs: list[str], in_place: bool = False) -> None:
    """Refuse to overwrite an input unless explicitly asked to."""
    if output in (None, "-") or in_place:
        return
    out = Path(output).resolve()
    for path in inputs:
        if Path(path).resolve() == out:
            raise HloShardError(f"output {output} is an input; pass --in-place to overwrite it")


def write_output(output: str | None, text: str) -> None:
    """Write ``text`` to ``output`` atomically (temp file in the same folder, then
    rename), or to stdout for ``None`` / ``-``. A failed run leaves nothing behind."""
    if output in (None, "-"):
        click.echo(text, nl=False)
        return
    target = Path(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                               dir=str(target.parent) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
