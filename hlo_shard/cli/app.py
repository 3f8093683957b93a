"""The click group and the helpers every command shares."""

from __future__ import annotations

import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from hlo_shard.dumps import pick_dump_file
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


class _UsageLine(click.ClickException):
    """A usage error as every other error: one ``error: …`` line, exit 2 (click's own
    prints the usage and a hint over four)."""

    exit_code = EXIT_USAGE

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _Commands(click.Group):
    """The command group: a command's usage error (a bad flag value, a directory where
    a file is named, a missing argument) in one line that names its ``--help``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            path = err.ctx.command_path if err.ctx is not None else ctx.command_path
            raise _UsageLine(f"{err.format_message()} (see '{path} --help')") from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hlo-shard")
def main() -> None:
    """Automatic cross-replica sharding of the weight update for XLA HLO text."""


def step_input(path: str) -> tuple[str, str]:
    """``path``, or for an XLA dump folder the file of its training step's per-device
    module (:func:`~hlo_shard.dumps.pick_dump_file`), and the line that says which (""
    for a file): every command that reads a step takes either, as optimize does."""
    if not Path(path).is_dir():
        return path, ""
    picked = str(pick_dump_file(Path(path)))
    return picked, f"read {path}'s training step: {picked}"


def fail(message: str) -> NoReturn:
    """Print one error line and exit with the usage/input status."""
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the command is so that it unwinds as from
    Ctrl-C: temporary files removed, replaced outputs put back, workers killed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_TERMINATIONS = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum: int, frame: Any) -> NoReturn:
    raise Terminated(signum)


def _raise_on_terminations() -> list[signal.Signals]:
    """From now on SIGTERM and SIGHUP raise :class:`Terminated` — where their default
    action (death) is in force and this is the main thread; the signals changed."""
    installed = []
    try:
        for signum in _TERMINATIONS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _raise_terminated)
                installed.append(signum)
    except ValueError:  # not the main thread
        pass
    return installed


def user_errors(command: Callable) -> Callable:
    """Turn every anticipated failure into a clean message and exit status 2,
    Ctrl-C into "interrupted" and 130 (never click's "Aborted!" and 1, which is
    verify's "outputs differ"), SIGTERM/SIGHUP into "terminated" and 128 + the
    signal, and a bug into "internal error" and 3 (the traceback with
    HLO_SHARD_DEBUG=1)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        installed = _raise_on_terminations()
        try:
            return command(*args, **kwargs)
        except HloParseError as err:  # one line: path:line:col: error: message
            click.echo(str(err), err=True)
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
        except KeyboardInterrupt as err:
            _interrupted(err)
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
        finally:
            for signum in installed:
                signal.signal(signum, signal.SIG_DFL)

    return wrapper


def _interrupted(err: KeyboardInterrupt) -> NoReturn:
    """Stop the execution workers at once (not after their current request), say so,
    exit 130 (Ctrl-C) or 128 + the signal (SIGTERM, SIGHUP). Further signals are
    ignored from here on, as the process is ending: one would turn the exit status
    into click's "Aborted!" (exit 1) or a death by the signal."""
    try:
        for signum in (signal.SIGINT, *_TERMINATIONS):
            signal.signal(signum, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    workers = sys.modules.get("hlo_shard.runtime.worker")
    if workers is not None:
        workers.kill_workers()
    if isinstance(err, Terminated):
        click.echo(f"error: terminated ({signal.Signals(err.signum).name})", err=True)
        sys.exit(128 + err.signum)
    click.echo("error: interrupted", err=True)
    sys.exit(EXIT_INTERRUPTED)
