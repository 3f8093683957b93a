"""The click group and the helpers every command shares."""

from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import click

from hlo_shard.errors import HloParseError, HloShardError
from hlo_shard.outputs import (check_distinct_outputs, check_output_path,  # noqa: F401
                               write_output, write_outputs)  # re-exported for the commands
from hlo_shard.source import read_text  # noqa: F401 - re-exported for the commands

EXIT_USAGE = 2
#: A bug in hlo-shard (never 1: verify's "outputs differ" must mean only that).
EXIT_INTERNAL = 3
#: Interrupted (Ctrl-C): 128 + SIGINT, as a shell reports it.
EXIT_INTERRUPTED = 130
#: Set to print the traceback of an internal error.
DEBUG_ENV = "HLO_SHARD_DEBUG"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hlo-shard")
def main() -> None:
    """Automatic cross-replica sharding of the weight update for XLA HLO text."""


def fail(message: str) -> NoReturn:
    """Print one error line and exit with the usage/input status."""
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def user_errors(command: Callable) -> Callable:
    """Turn every anticipated failure into a clean message and exit status 2,
    Ctrl-C into "interrupted" and 130 (never click's "Aborted!" and 1, which is
    verify's "outputs differ"), and a bug into "internal error" and 3 (the traceback
    with HLO_SHARD_DEBUG=1)."""

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
        except KeyboardInterrupt:
            _interrupted()
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors (exit 2), ctx.exit()
        except Exception as err:  # noqa: BLE001 - a bug, reported as one
            if os.environ.get(DEBUG_ENV):
                traceback.print_exc()
            detail = str(err).splitlines()[0][:200] if str(err) else ""
            click.echo(f"error: internal error ({type(err).__name__}{': ' if detail else ''}"
                       f"{detail}); please report it (set {DEBUG_ENV}=1 for the traceback)",
                       err=True)
            sys.exit(EXIT_INTERNAL)

    return wrapper


def _interrupted() -> NoReturn:
    """Stop the execution workers at once (not after their current request), say so,
    exit 130. Further Ctrl-C are ignored from here on, as the process is ending: one
    would turn exit 130 into click's "Aborted!" (exit 1) or a death by SIGINT."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    workers = sys.modules.get("hlo_shard.runtime.worker")
    if workers is not None:
        workers.kill_workers()
    click.echo("error: interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)
