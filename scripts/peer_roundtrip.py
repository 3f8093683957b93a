"""Round-trip every ``.hlo`` file of a folder through hlo-shard's front end and XLA's parser.

    python scripts/peer_roundtrip.py FOLDER [--jobs N] [--timeout S] [--verbose]

For each module T (the folder is searched recursively): XLA's parser reads T; hlo-shard
reads T and prints it; XLA reads that output. The module is *identical* when XLA prints
the same module for both (``xla(to_text(parse(T))) == xla(T)``), an *error* when
hlo-shard refuses T (or crashes, or runs past the timeout), *differ* when XLA refuses
hlo-shard's output or reads another module from it. Modules XLA's parser itself refuses
(or aborts on, or runs past the timeout on) are *not accepted by XLA* and left out of
the count. The last line reads ``K/M identical (E errors, D differ, X not accepted by
XLA)``, M being the modules XLA accepts; exit status 0 when K = M, 1 otherwise, 2 for a
bad argument. ``--verbose`` names each module that is not identical, with the reason.

Each module is read in a worker process (``--jobs`` of them, reused between modules):
XLA's parser aborts its process on some inputs, and a worker that dies or runs past
``--timeout`` seconds on one module is replaced without losing the others.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

ROOT = Path(__file__).resolve().parents[1]

#: Verdict kinds, in the order of the summary line.
IDENTICAL, ERROR, DIFFER, NOT_ACCEPTED = "identical", "error", "differ", "not accepted by XLA"


@dataclass(frozen=True)
class Verdict:
    path: str
    kind: str
    reason: str = ""


# ------------------------------------------------------------------------ worker side

def _round_trip(path: str, report_stage) -> tuple[str, str]:
    """(kind, reason) for one module, read in this (worker) process."""
    from jax._src.lib import xla_client as xc

    from hlo_shard import parse, to_text

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return NOT_ACCEPTED, f"unreadable: {err}"
    try:
        expected = xc.hlo.hlo_module_from_text(text).to_string()
    except Exception as err:  # noqa: BLE001 - XLA's refusal, whatever its type
        return NOT_ACCEPTED, _first_line(str(err))
    report_stage()  # from here on a death or a timeout is ours or our output's
    try:
        printed = to_text(parse(text, path))
    except Exception as err:  # noqa: BLE001 - a refusal or a crash of the front end
        return ERROR, _first_line(str(err)) if type(err).__name__ == "HloParseError" else \
            f"{type(err).__name__}: {_first_line(str(err))}"
    try:
        got = xc.hlo.hlo_module_from_text(printed).to_string()
    except Exception as err:  # noqa: BLE001
        return DIFFER, f"XLA refuses hlo-shard's output: {_first_line(str(err))}"
    if got == expected:
        return IDENTICAL, ""
    changed = [line for line in difflib.unified_diff(
        expected.splitlines(), got.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    return DIFFER, "XLA reads another module: " + " | ".join(changed[:2])[:300]


def _first_line(message: str) -> str:
    lines = [line for line in message.splitlines() if "error" in line] or message.splitlines()
    return (lines[-1] if lines else message).strip()[:300]


def _worker() -> None:
    """Read paths from stdin, one a line; answer each with JSON lines on stdout."""
    sys.path.insert(0, str(ROOT))
    out = sys.stdout

    def report_stage() -> None:
        out.write('{"stage": "ours"}\n')
        out.flush()

    for line in sys.stdin:
        kind, reason = _round_trip(line.rstrip("\n"), report_stage)
        out.write(json.dumps({"kind": kind, "reason": reason}) + "\n")
        out.flush()


# ------------------------------------------------------------------------ parent side

class _Worker:
    """One worker process; replaced when it dies or runs past the timeout."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            cwd=ROOT)
        self.requests = cast(IO[str], self.process.stdin)
        self.answers = cast(IO[str], self.process.stdout)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.answers:
            self.lines.put(line)
        self.lines.put(None)  # end of output: the worker died

    def round_trip(self, path: str, timeout: float) -> Verdict:
        self.requests.write(path + "\n")
        self.requests.flush()
        stage = "xla"
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                return Verdict(path, NOT_ACCEPTED if stage == "xla" else ERROR,
                               f"timed out after {timeout:g} s "
                               f"({'XLA' if stage == 'xla' else 'hlo-shard or XLA on its output'})")
            if line is None:
                why = f"worker died ({self._fatal_line()})"
                return Verdict(path, NOT_ACCEPTED if stage == "xla" else DIFFER,
                               ("XLA aborts: " if stage == "xla" else "XLA aborts on "
                                "hlo-shard's output: ") + why)
            result = json.loads(line)
            if "stage" in result:
                stage = result["stage"]
                continue
            return Verdict(path, result["kind"], result["reason"])

    def _fatal_line(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").splitlines()
        fatal = [line for line in lines if line.startswith("F")]
        return (fatal[0] if fatal else lines[-1] if lines else "no message")[:300]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.log.close()


def round_trip_folder(folder: Path, jobs: int, timeout: float) -> list[Verdict]:
    """One verdict per ``.hlo`` file under ``folder``, in path order."""
    paths = sorted(str(p) for p in folder.rglob("*.hlo") if p.is_file())
    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(paths)):
        todo.put(index)
    verdicts: list[Verdict | None] = [None] * len(paths)

    def run_slot() -> None:
        worker = _Worker()
        try:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                verdict = worker.round_trip(paths[index], timeout)
                verdicts[index] = verdict
                if worker.process.poll() is not None or "timed out" in verdict.reason \
                        or "worker died" in verdict.reason:
                    worker.close()
                    worker = _Worker()
        finally:
            worker.close()

    threads = [threading.Thread(target=run_slot) for _ in range(max(1, min(jobs, len(paths))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [v for v in verdicts if v is not None]


def summary(verdicts: list[Verdict]) -> str:
    count = {kind: sum(v.kind == kind for v in verdicts)
             for kind in (IDENTICAL, ERROR, DIFFER, NOT_ACCEPTED)}
    accepted = count[IDENTICAL] + count[ERROR] + count[DIFFER]
    return (f"{count[IDENTICAL]}/{accepted} identical ({count[ERROR]} errors, "
            f"{count[DIFFER]} differ, {count[NOT_ACCEPTED]} not accepted by XLA)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes (default: one per CPU)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per module (default 60)")
    parser.add_argument("--verbose", action="store_true",
                        help="name each module that is not identical, with the reason")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return 0
    if args.folder is None or not args.folder.is_dir():
        print(f"peer_roundtrip: {args.folder} is not a folder", file=sys.stderr)
        return 2
    if args.jobs < 1 or not args.timeout > 0:
        print("peer_roundtrip: --jobs and --timeout must be positive", file=sys.stderr)
        return 2
    verdicts = round_trip_folder(args.folder, args.jobs, args.timeout)
    if args.verbose:
        for verdict in verdicts:
            if verdict.kind != IDENTICAL:
                print(f"{verdict.path}: {verdict.kind}: {verdict.reason}")
    print(summary(verdicts))
    accepted = [v for v in verdicts if v.kind != NOT_ACCEPTED]
    return 0 if all(v.kind == IDENTICAL for v in accepted) else 1


if __name__ == "__main__":
    sys.exit(main())
