"""Writing a command's output files: all of them or none, and nothing else touched.

A regular file is replaced atomically: the new contents go to a temporary file in
the target's own folder (``.NAME.hlo-shard-tmp-PID-XXXX``, after following symlinks,
so a symlink stays a symlink), which then takes the target's name. What that must
not do, and so does not:

* rename over anything that is not a regular file — ``-o /dev/null`` as root would
  replace the device. Character devices and pipes (``/dev/null``, ``/dev/full``,
  ``>(cat)``, ``/dev/stdout``) are written directly; other kinds are refused;
* change the file's mode: a replaced file keeps its mode (and owner, where allowed),
  a new one gets the umask's, as ``open()`` would;
* break hard links: a target with several links is rewritten in place (its old
  contents restored if that fails);
* leave half a set of outputs: every temporary file of a command is written before
  the first one is renamed, and a failure of any later step puts the replaced files
  back (:func:`write_outputs`);
* leave debris: temporary files of a process that no longer exists (killed during a
  write) are removed by the next write into that folder;
* name its temporary file in an error: messages name the path the user gave.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator, Sequence

import click

from hlo_shard.errors import HloShardError

#: Marks hlo-shard's temporary files; the process id follows, so stale ones are known.
TEMP_MARK = ".hlo-shard-tmp-"
_TEMP_NAME = re.compile(rf"^\..*{re.escape(TEMP_MARK)}(\d+)-[0-9a-f]+(?:\.old)?$")
_NAME_KEPT = 100  # of the target's name in a temporary's, to stay under NAME_MAX
_DESCRIPTOR_FOLDER = re.compile(r"^/proc/(?:self|\d+)/fd$")


def is_stdout(path: str | None) -> bool:
    return path in (None, "-")


# ------------------------------------------------------------------------ checking


def check_output_path(output: str | None, inputs: Sequence[str],
                      in_place: bool | None = None) -> None:
    """Refuse to overwrite an input unless explicitly asked to (``in_place``: the
    command's ``--in-place``; None where the output has no such flag)."""
    if output is None or output == "-" or in_place:
        return
    for path in inputs:
        if _same_file(output, path):
            remedy = "name another file" if in_place is None else \
                "pass --in-place to overwrite it"
            raise HloShardError(f"output {output} is an input; {remedy}")


def check_distinct_outputs(outputs: dict[str, str | None]) -> None:
    """Refuse two outputs of one command naming the same file (``--manifest`` equal
    to ``-o`` would silently lose the module); a character device such as
    ``/dev/null`` may take several."""
    named = [(flag, path) for flag, path in outputs.items() if path is not None]
    for i, (flag, path) in enumerate(named):
        for other_flag, other in named[i + 1:]:
            both_stdout = is_stdout(path) and is_stdout(other)
            if both_stdout or (not is_stdout(path) and not is_stdout(other)
                               and not _is_character_device(path) and _same_file(path, other)):
                raise HloShardError(f"{flag} and {other_flag} name the same file ({path}); "
                                    "give each output its own path")


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _is_character_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


# ------------------------------------------------------------------------- writing


@dataclass
class _Output:
    """One output on its way: how it is written, and how it is undone."""

    requested: str  #: the path the user gave, for messages
    data: bytes
    how: str  #: "stdout" | "direct" | "rename" | "rewrite"
    target: Path = Path()
    temp: Path | None = None
    backup: Path | None = None
    previous: bytes | None = None  #: a rewritten file's old contents
    existed: bool = False
    done: bool = field(default=False)


def write_output(output: str | None, data: str | bytes) -> None:
    """Write one output (see :func:`write_outputs`)."""
    write_outputs([(output, data)])


def write_outputs(outputs: Sequence[tuple[str | None, str | bytes | None]]) -> None:
    """Write every ``(path, data)`` pair (``None`` or ``-``: standard output; data
    None: skipped) or, when any step fails, none: the files replaced so far are put
    back and the error names the user's path."""
    staged: list[_Output] = []
    try:
        for path, data in outputs:
            if data is not None:
                staged.append(_stage(path, data.encode("utf-8") if isinstance(data, str)
                                     else data))
        order = ("rename", "rewrite", "direct", "stdout")  # undoable steps first
        for item in sorted(staged, key=lambda o: order.index(o.how)):
            _commit(item)
    except BaseException:
        for item in reversed(staged):
            _undo(item)
        raise
    finally:
        for item in staged:
            for leftover in (item.temp, item.backup):
                if leftover is not None:
                    _unlink_quietly(leftover)


def _stage(path: str | None, data: bytes) -> _Output:
    if path is None or path == "-":
        return _Output("stdout", data, "stdout")
    with _naming(path):
        try:
            info = os.stat(path)
        except FileNotFoundError:
            info = None  # missing, or a dangling symlink: created where it points
        if info is not None and stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if info is not None and not stat.S_ISREG(info.st_mode):
            if stat.S_ISCHR(info.st_mode) or stat.S_ISFIFO(info.st_mode):
                return _Output(path, data, "direct", Path(path))
            raise HloShardError(f"{path}: not a regular file, character device or pipe; "
                                "refusing to write to it")
        if _is_descriptor(path):
            return _Output(path, data, "direct", Path(path))
        target = Path(os.path.realpath(path))
        _remove_stale_temporaries(target.parent)
        if info is not None and info.st_nlink > 1:
            return _Output(path, data, "rewrite", target, existed=True)
        temp = _write_temporary(target, data, info)
        return _Output(path, data, "rename", target, temp, existed=info is not None)


def _commit(item: _Output) -> None:
    with _naming(item.requested):
        if item.how == "stdout":
            click.echo(item.data, nl=False)
        elif item.how == "direct":  # never truncated: /dev/stdout may be a log, `>>`
            with open(os.open(item.target, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC),
                      "wb") as handle:
                handle.write(item.data)
        elif item.how == "rewrite":
            item.previous = item.target.read_bytes()
            item.done = True
            _overwrite(item.target, item.data)
        else:
            if item.existed:
                item.backup = _temporary_name(item.target, ".old")
                try:
                    os.link(item.target, item.backup)
                except OSError:
                    item.backup = None  # no hard links here: this one cannot be undone
            assert item.temp is not None
            os.replace(item.temp, item.target)
            item.temp = None
        item.done = True


def _undo(item: _Output) -> None:
    """Put back what a committed output replaced (best effort: the error that made
    us undo is the one reported)."""
    if not item.done:
        return
    try:
        if item.how == "rewrite" and item.previous is not None:
            _overwrite(item.target, item.previous)
        elif item.how == "rename":
            if item.backup is not None:
                os.replace(item.backup, item.target)
                item.backup = None
            elif not item.existed:
                item.target.unlink()
    except OSError:
        pass


def _overwrite(target: Path, data: bytes) -> None:
    with open(target, "r+b") as handle:
        handle.truncate(0)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _write_temporary(target: Path, data: bytes, info: os.stat_result | None) -> Path:
    """``data`` in a new file next to ``target``, with the mode the target has (or
    the umask gives a new file), flushed to disk."""
    temp = _temporary_name(target)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        if info is not None:
            os.fchmod(fd, stat.S_IMODE(info.st_mode))
            if (info.st_uid, info.st_gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(fd, info.st_uid, info.st_gid)
                except OSError:
                    pass
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(temp)
        raise
    os.close(fd)
    return temp


def _temporary_name(target: Path, suffix: str = "") -> Path:
    name = f".{target.name[:_NAME_KEPT]}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}{suffix}"
    return target.parent / name


def _remove_stale_temporaries(folder: Path) -> None:
    """Delete temporary files left by hlo-shard processes that no longer exist."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match and not _process_exists(int(match.group(1))) and entry.is_file(
                follow_symlinks=False):
            _unlink_quietly(Path(entry.path))


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _is_descriptor(path: str) -> bool:
    """``/dev/stdout``, ``/dev/fd/3``, ``/proc/self/fd/1``: an open descriptor of this
    process, written in place even when it is a regular file (it may be open for
    appending: replacing the file would lose what it held)."""
    absolute = os.path.abspath(path)
    if _DESCRIPTOR_FOLDER.match(os.path.realpath(os.path.dirname(absolute))):
        return True
    return os.path.islink(absolute) and bool(
        _DESCRIPTOR_FOLDER.match(os.path.dirname(os.readlink(absolute))))


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Re-raise an OSError as one about the user's ``path`` (never a temporary's)."""
    try:
        yield
    except OSError as err:
        if err.filename == path:
            raise
        raise OSError(err.errno, err.strerror or str(err), path) from None
