"""The tool never damages the machine it runs on or loses data (issue 16, items 1-6, 8-10).

Each test is a regression test of one hostile case: the command's exit status, its one
``error:`` line (no traceback), no output or temporary file left, the input unchanged,
no process left behind. Commands run as real processes (``python -m hlo_shard``, or
forked from a server that imported the CLI once: :func:`hlo_shard.fuzz.hostile.run_cli`)
except where a test needs the test process's umask or a patched function.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hlo_shard.cli import main
from hlo_shard.fuzz.hostile import CliRun, run_cli
from hlo_shard.outputs import TEMP_MARK

REPO = Path(__file__).resolve().parents[1]
SGD = REPO / "fixtures" / "spmd" / "sgd.n4.hlo"
ADAM = REPO / "fixtures" / "spmd" / "adam.n2.hlo"
PYTHON = [sys.executable, "-m", "hlo_shard"]
#: Seconds a process may take to disappear after the event that must end it.
GONE_WITHIN = 20

#: A module that computes for minutes (a sine two billion times over), so that a
#: worker is busy when its parent is killed or interrupted.
SPIN = """HloModule spin

%cond (s: (s32[], f32[256])) -> pred[] {
  %s = (s32[], f32[256]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(2000000000)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (s: (s32[], f32[256])) -> (s32[], f32[256]) {
  %s = (s32[], f32[256]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %v = f32[256] get-tuple-element(%s), index=1
  %w = f32[256] sine(%v)
  ROOT %t = (s32[], f32[256]) tuple(%j, %w)
}

ENTRY %e (x: f32[256]) -> f32[256] {
  %x = f32[256] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]) tuple(%zero, %x)
  %loop = (s32[], f32[256]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[256] get-tuple-element(%loop), index=1
}
"""

#: A module whose sort needs a 1.6 GB buffer.
BIG = """HloModule big

%lt (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %e (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %i = f32[400000000] iota(), iota_dimension=0
  %b = f32[400000000] broadcast(%x), dimensions={}
  %m = f32[400000000] multiply(%i, %b)
  %s = f32[400000000] sort(%m), dimensions={0}, to_apply=%lt
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%s, %zero), dimensions={0}, to_apply=%add
}
"""

_ERROR = re.compile(r"^(?:.+?:\d+:\d+: )?error: \S")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(*args, timeout: float = 120, env: dict | None = None) -> CliRun:
    """``hlo-shard ARGS`` in its own process (with ``env`` added: a fresh interpreter)."""
    args = [str(a) for a in args]
    if env is None:
        return run_cli(args, timeout)
    proc = subprocess.run(PYTHON + args, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})
    return CliRun(args, proc.returncode, proc.stdout, proc.stderr, 0.0)


def _one_error(run: CliRun, status: int = 2, message: str = "") -> str:
    """The run failed with ``status`` and exactly one ``error:`` line (matching
    ``message``), no traceback; that line."""
    what = f"`hlo-shard {' '.join(run.args)}`"
    assert not run.timed_out, f"{what} did not finish"
    assert "Traceback" not in run.stderr, f"{what} printed a traceback:\n{run.stderr}"
    assert run.returncode == status, f"{what} exited {run.returncode}:\n{run.stderr[-2000:]}"
    lines = run.stderr.rstrip("\n").splitlines()
    errors = [i for i, line in enumerate(lines) if _ERROR.match(line)]
    tail = lines[errors[0] + 1:] if len(errors) == 1 else []
    assert len(errors) == 1 and not tail, \
        f"{what}: not one error line at the end:\n{run.stderr}"
    errors = [lines[errors[0]]]
    assert re.search(message, errors[0]), f"{what}: {errors[0]!r} does not say {message!r}"
    return errors[0]


def _ok(run: CliRun) -> None:
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _formatted(path: Path = SGD) -> bytes:
    run = _cli("fmt", path)
    _ok(run)
    return run.stdout.encode()


@pytest.fixture(autouse=True, scope="module")
def inputs_unchanged():
    """No case modifies the fixtures it reads."""
    before = {path: _digest(path) for path in (SGD, ADAM)}
    yield
    assert {path: _digest(path) for path in before} == before


@pytest.fixture(autouse=True)
def no_worker_left():
    """After every case, no execution worker of this checkout outlives its command."""
    yield
    deadline = time.monotonic() + GONE_WITHIN
    while (left := _workers_left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"workers left running: {left}"


def _workers_left() -> list[int]:
    """Workers of this checkout not started by a test process (in-process runs keep a
    pooled worker until exit)."""
    child = str(REPO / "hlo_shard" / "runtime" / "_child.py")
    tests = _test_processes()
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and child in (entry / "cmdline").read_bytes().decode(
                    errors="replace").split("\0") and not _gone(int(entry.name)) \
                    and _parent(int(entry.name)) not in tests:
                left.append(int(entry.name))
        except OSError:
            continue
    return left


def _test_processes() -> set[int]:
    """This process and, under pytest-xdist, the other workers of its run (children of
    the same controller): each keeps its own pooled worker until it exits."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return {os.getpid()}
    return {os.getpid(), *_children(os.getppid())}


def _parent(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


# ------------------------------------------------ 1. devices, pipes, symlinks


def test_fifo_output_is_written_through_not_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    received = b""
    proc = subprocess.Popen(PYTHON + ["fmt", str(SGD), "-o", str(fifo)], cwd=REPO,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if select.select([reader], [], [], 0.2)[0]:
            chunk = os.read(reader, 1 << 16)
            if not chunk and proc.poll() is not None:
                break  # the writer closed it
            received += chunk
            if not chunk:
                time.sleep(0.02)  # no writer yet
    os.close(reader)
    proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr.read()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced"
    assert received == _formatted() and _listing(tmp_path) == ["fifo"]


def test_dev_null_stays_a_device():
    before = os.stat("/dev/null")
    _ok(_cli("fmt", SGD, "-o", "/dev/null"))
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    assert after.st_ino == before.st_ino


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_dev_full_reports_the_full_disk():
    _one_error(_cli("fmt", SGD, "-o", "/dev/full"), message=r"^error: /dev/full: No space left")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_socket_is_refused_and_kept(tmp_path):
    path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    try:
        _one_error(_cli("fmt", SGD, "-o", path), message=rf"^error: {path}: not a regular file")
        assert stat.S_ISSOCK(os.stat(path).st_mode) and _listing(tmp_path) == ["sock"]
    finally:
        server.close()


def test_symlink_output_replaces_its_target_and_stays_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "module.hlo"
    target.write_text("old\n")
    link = tmp_path / "link.hlo"
    link.symlink_to(target)
    _ok(_cli("fmt", SGD, "-o", link))
    assert link.is_symlink() and target.read_bytes() == _formatted()
    assert _listing(tmp_path) == ["link.hlo", "real"] and _listing(tmp_path / "real") == [
        "module.hlo"]


def test_dev_stdout_opened_for_appending_keeps_what_it_held(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"previous\n")
    with open(log, "ab") as stdout:
        proc = subprocess.run(PYTHON + ["fmt", str(SGD), "-o", "/dev/stdout"], cwd=REPO,
                              stdout=stdout, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert log.read_bytes() == b"previous\n" + _formatted() and _listing(tmp_path) == ["log"]


# ------------------------------------------- 2, 3. workers die with their parent


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _parent(int(entry.name)) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts as gone: it runs nothing)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def spin(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spin") / "spin.hlo"
    path.write_text(SPIN)
    return path


def _default_terminations() -> None:
    """In the child: the signals' default actions, whatever the suite was started
    under (``nohup`` ignores SIGHUP, and verify rightly leaves an ignored signal
    ignored, so the SIGHUP case would wait forever)."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


@pytest.fixture
def busy_verify(spin):
    """Starts ``verify`` of a minutes-long module and returns once its worker is
    computing: (the parent, the worker's pid). Whatever the test leaves is killed."""
    started: list[tuple[subprocess.Popen, int]] = []

    def start() -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(PYTHON + ["verify", str(spin), "--timeout", "600"], cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=_default_terminations)
        for line in proc.stderr:
            if line.startswith("step 1/1"):
                break
        workers = _children(proc.pid)
        started.append((proc, workers[0] if workers else 0))
        assert len(workers) == 1, f"verify ended before running: {proc.wait()}"
        time.sleep(0.5)  # well into the computation
        return started[-1]

    yield start
    for proc, worker in started:
        proc.kill()
        proc.wait()
        if worker and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_worker_dies_with_a_killed_parent(busy_verify):
    """SIGKILL: no cleanup in the parent runs; the kernel (PR_SET_PDEATHSIG) and the
    watchdog end the worker."""
    proc, worker = busy_verify()
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=GONE_WITHIN) == -signal.SIGKILL
    assert _wait_gone(worker), f"worker {worker} outlived its parent"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_terminated_verify_kills_its_worker_and_says_so(sig, busy_verify):
    proc, worker = busy_verify()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=GONE_WITHIN)
    run = CliRun(["verify"], proc.returncode, stdout, stderr, 0)
    _one_error(run, status=128 + sig, message=rf"^error: terminated \({sig.name}\)$")
    assert _wait_gone(worker), f"worker {worker} outlived its parent ({sig.name})"


def test_terminated_during_a_write_puts_back_what_it_replaced(tmp_path):
    """optimize -o out --manifest FIFO: the module is renamed into place, then the
    manifest's write waits for a reader; SIGTERM then must put the old module back
    and leave no temporary file."""
    old = _old_outputs(tmp_path, "o.hlo")
    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    proc = subprocess.Popen(PYTHON + ["optimize", str(SGD), "-o", str(tmp_path / "o.hlo"),
                                      "--manifest", str(fifo)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while (tmp_path / "o.hlo").read_bytes() == old["o.hlo"] \
                and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)  # until the module is in place and the FIFO write waits
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=GONE_WITHIN)
    finally:
        proc.kill()
    run = CliRun(["optimize"], proc.returncode, stdout, stderr, 0)
    _one_error(run, status=128 + signal.SIGTERM, message=r"^error: terminated \(SIGTERM\)$")
    assert _listing(tmp_path) == ["m.json", "o.hlo"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert (tmp_path / "o.hlo").read_bytes() == old["o.hlo"]


def test_worker_started_from_a_thread_dies_with_its_parent(spin):
    """A worker started from a thread cannot use PR_SET_PDEATHSIG (it fires when that
    thread ends): the pipe watchdog alone must end it, in the middle of a computation."""
    script = ("import os, signal, sys, threading, time\n"
              "import numpy as np\n"
              "from hlo_shard.runtime import _child\n"
              "from hlo_shard.runtime.worker import Worker\n"
              "w = Worker('cpu', 1)\n"
              "t = threading.Thread(target=w.start); t.start(); t.join()\n"
              "handle = w.request('compile', text=open(sys.argv[1]).read(), replicas=1)\n"
              "_child.write_message(w._requests, {'op': 'execute', 'handle': handle['handle'],\n"
              "                     'arguments': [[np.zeros(256, np.float32)]]})\n"
              "time.sleep(1)\n"
              "print(w._process.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(spin)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _wait_gone(int(proc.stdout.split()[0])), "the watchdog did not end the worker"


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_kills_the_worker_and_exits_130(presses, spin, busy_verify):
    proc, worker = busy_verify()
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=60)  # not --timeout's 600 s
    run = CliRun(["verify", str(spin)], proc.returncode, stdout, stderr, 0)
    _one_error(run, status=130, message=r"^error: interrupted$")
    assert "Aborted" not in stderr and "timed out" not in stderr
    assert _wait_gone(worker), "Ctrl-C left the worker running"


# ------------------------------------------------------ 4. all outputs or none


def _old_outputs(folder: Path, *names: str) -> dict[str, bytes]:
    folder.mkdir(exist_ok=True)
    contents = {}
    for name in names:
        (folder / name).write_bytes(f"old {name}\n".encode())
        contents[name] = (folder / name).read_bytes()
    return contents


def _unchanged(folder: Path, contents: dict[str, bytes]) -> None:
    assert _listing(folder) == sorted(contents), f"left behind: {_listing(folder)}"
    for name, data in contents.items():
        assert (folder / name).read_bytes() == data, f"{name} was replaced"


@pytest.mark.parametrize("second", ["missing/m.json", "/dev/full"])
def test_optimize_writes_module_and_manifest_or_neither(second, tmp_path):
    old = _old_outputs(tmp_path / "out", "o.hlo")
    manifest = second if second.startswith("/") else str(tmp_path / second)
    before = _digest(SGD)
    _one_error(_cli("optimize", SGD, "-o", tmp_path / "out" / "o.hlo", "--manifest", manifest),
               message=rf"^error: {re.escape(manifest)}: ")
    _unchanged(tmp_path / "out", old)
    assert _digest(SGD) == before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_optimize_json_that_cannot_be_printed_leaves_the_files_as_they_were(tmp_path):
    """``--json`` on stdout is one of optimize's outputs: where printing it fails, the
    module and manifest written are put back as they were (it left them replaced)."""
    old = _old_outputs(tmp_path, "o.hlo")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(PYTHON + ["optimize", str(SGD), "-o", str(tmp_path / "o.hlo"),
                                        "--manifest", str(tmp_path / "m.json"), "--json"],
                              cwd=REPO, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "error: stdout: No space left on device"
    _unchanged(tmp_path, old)


@pytest.mark.parametrize("command", [("report", SGD), ("diff", SGD, SGD), ("scale", SGD)],
                         ids=lambda c: c[0])
def test_report_diff_scale_write_html_and_text_or_neither(command, tmp_path):
    old = _old_outputs(tmp_path, "r.txt")
    _one_error(_cli(*command, "--html", "/dev/full", "-o", tmp_path / "r.txt"),
               message=r"^error: /dev/full: No space left")
    _unchanged(tmp_path, old)


@pytest.mark.parametrize("flags", [("optimize", "--manifest"), ("report", "--html"),
                                   ("scale", "--plot")], ids=lambda f: f[0])
def test_two_outputs_naming_one_file_are_refused(flags, tmp_path):
    command, flag = flags
    old = _old_outputs(tmp_path, "x")
    (tmp_path / "link").symlink_to(tmp_path / "x")
    old["link"] = old["x"]
    for other in ("x", "./x", "link"):
        _one_error(_cli(command, SGD, "-o", tmp_path / "x", flag, tmp_path / other),
                   message=rf"-o and {flag} name the same file")
        _unchanged(tmp_path, old)


# ------------------------------------------------------------- 5. one line, exit 2


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300", "0"])
def test_bad_timeout_is_one_line(value):
    _one_error(_cli("verify", SGD, "--timeout", value), message=r"--timeout must be between")


def test_negative_seed_is_a_usage_error():
    run = _cli("verify", SGD, "--seed", "-1")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "'--seed': -1 is not in the range" in run.stderr


def test_parameter_number_beyond_the_signature_is_one_line(tmp_path):
    bad = tmp_path / "p7.hlo"
    bad.write_text("HloModule p7\n\nENTRY %e (x: f32[4]) -> f32[4] {\n"
                   "  ROOT %x = f32[4] parameter(7)\n}\n")
    _one_error(_cli("verify", bad), message=rf"^{re.escape(str(bad))}:4:\d+: error: invalid "
                                            "parameter number")


def test_a_bug_is_exit_3_never_verify_s_1(monkeypatch):
    """Exit 1 means only "outputs differ": an internal error is one line and 3."""
    import hlo_shard.printer

    def broken(module):
        raise ValueError("a bug\nsecond line")

    monkeypatch.setattr(hlo_shard.printer, "to_text", broken)
    result = CliRunner().invoke(main, ["fmt", str(SGD)])
    assert result.exit_code == 3 and result.output.splitlines() == [
        "error: internal error (ValueError: a bug); please report it (set HLO_SHARD_DEBUG=1 "
        "for the traceback)"]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> tuple[Path, dict]:
    """adam.n2 optimized with sharded state, and its manifest (sharded records,
    feedback)."""
    folder = tmp_path_factory.mktemp("optimized")
    _ok(_cli("optimize", ADAM, "-o", folder / "o.hlo", "--manifest", folder / "m.json",
             "--state", "sharded", "--force"))
    return folder / "o.hlo", json.loads((folder / "m.json").read_text())


def _first_sharded(data: dict) -> dict:
    return next(r for r in data["parameters"] if r["kind"] == "sharded")


#: (what is broken, how, the place and complaint the message must show).
_BAD_MANIFESTS = [
    ("length string", lambda d: _first_sharded(d)["shard"].update(length="abc"),
     r"shard\.length: expected a whole number, got \"abc\""),
    ("length null", lambda d: _first_sharded(d)["shard"].update(length=None),
     r"shard\.length: expected a whole number, got null"),
    ("length list", lambda d: _first_sharded(d)["shard"].update(length=[4]),
     r"shard\.length: expected a whole number, got \[4\]"),
    ("length 4.9", lambda d: _first_sharded(d)["shard"].update(length=4.9),
     r"shard\.length: expected a whole number, got 4\.9"),
    ("groups 5", lambda d: _first_sharded(d)["shard"].update(replica_groups=5),
     r"shard\.replica_groups: expected a list, got 5"),
    ("feedback string", lambda d: d.update(feedback="0:0"),
     r"feedback: expected a list, got \"0:0\""),
    ("feedback []", lambda d: d.update(feedback=[]), r"feedback: expected a non-empty list"),
    ("feedback entry", lambda d: d.update(feedback=[{"output": 0}]),
     r"feedback\[0\]: missing field 'parameter'"),
    ("feedback list", lambda d: d.update(feedback=[[0, 0]]),
     r"feedback\[0\]: expected an object"),
    ("devices 1e30", lambda d: d.update(devices=1e30), r"devices: expected a whole number"),
    ("devices 10**30", lambda d: d.update(devices=10 ** 30),
     r"devices: expected a whole number between 1 and 1024"),
    ("kind 3", lambda d: d["outputs"][0].update(kind=3), r"outputs\[0\]\.kind: expected a string"),
    ("shape", lambda d: d["outputs"][0].update(shape="16"), r"outputs\[0\]\.shape: expected a list"),
    ("index -1", lambda d: d["outputs"][0].update(index=-1), r"outputs\[0\]\.index: .*at least 0"),
    ("parameters", lambda d: d.update(parameters={}), r"parameters: expected a list"),
]


@pytest.mark.parametrize("case", _BAD_MANIFESTS, ids=[c[0] for c in _BAD_MANIFESTS])
def test_malformed_manifest_is_one_located_line(case, manifest, tmp_path):
    _, mutate, complaint = case
    optimized, data = manifest
    data = json.loads(json.dumps(data))
    mutate(data)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    _one_error(_cli("verify", ADAM, optimized, "--manifest", path),
               message=rf"^error: manifest {re.escape(str(path))}: (parameters\[\d+\]\.)?"
                       rf"{complaint}")


def test_non_utf8_manifest_is_one_line(manifest, tmp_path):
    optimized, data = manifest
    path = tmp_path / "m.json"
    path.write_bytes(json.dumps(data).encode().replace(b'"kind"', b'"ki\xffnd"', 1))
    _one_error(_cli("verify", ADAM, optimized, "--manifest", path),
               message=r"not UTF-8 text \(byte 0xff at line 1\)")


def _profile() -> dict:
    return json.loads((REPO / "hlo_shard" / "profiles" / "cpu-generic.json").read_text())


_BAD_PROFILES = [
    (lambda p: p.update(memory_bandwidth_bytes_per_s="fast"),
     r"memory_bandwidth_bytes_per_s: expected a finite number, got \"fast\""),
    (lambda p: p.update(transcendentals_per_s="68719476736"),
     r"transcendentals_per_s: expected a finite number"),
    (lambda p: p.update(transcendentals_per_s=1e400), r"transcendentals_per_s: expected a finite"),
    (lambda p: p["interconnect"].update(intra_node={"alpha_s": "1us", "beta_bytes_per_s": 1}),
     r"interconnect\.intra_node\.alpha_s: expected a finite number"),
    (lambda p: p.update(interconnect=[]), r"interconnect: expected an object"),
    (lambda p: p["matrix_flops_per_s"].update(f32=None), r"matrix_flops_per_s\.f32: expected"),
    (lambda p: p.update(upcasts_16bit_floats="no"), r"upcasts_16bit_floats: expected true or false"),
    (lambda p: p["interconnect"].update(devices_per_node=2.5),
     r"interconnect\.devices_per_node: expected a whole number"),
]


@pytest.mark.parametrize("case", _BAD_PROFILES, ids=[str(i) for i in range(len(_BAD_PROFILES))])
def test_malformed_profile_is_one_located_line(case, tmp_path):
    mutate, complaint = case
    profile = _profile()
    mutate(profile)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile).replace("1e+400", "1e400").replace("Infinity", "1e400"))
    _one_error(_cli("report", SGD, "--profile", path, "-o", tmp_path / "r.txt"),
               message=rf"^error: profile {re.escape(str(path))}: {complaint}")
    assert _listing(tmp_path) == ["p.json"]


# ----------------------------------------------------------------------- 6. bounds


def test_device_count_is_bounded():
    _one_error(_cli("verify", SGD, "--devices", "100000"),
               message=r"--devices: 100000 devices, more than the limit of 1024; raise it "
                       r"with --max-devices or HLO_SHARD_MAX_DEVICES")
    _one_error(_cli("verify", SGD, "--max-devices", "2"),
               message=r"4 devices, more than the limit of 2")


def test_replica_count_is_bounded():
    _one_error(_cli("scale", SGD, "--replicas", "8,100000000"),
               message=r"--replicas: 100000000 replicas, more than the limit of 65536; raise "
                       r"it with --max-replicas or HLO_SHARD_MAX_REPLICAS")
    _one_error(_cli("scale", SGD, "--replicas", "8", env={"HLO_SHARD_MAX_REPLICAS": "4"}),
               message=r"8 replicas, more than the limit of 4")


def test_endless_input_is_bounded(tmp_path):
    _one_error(_cli("fmt", "/dev/zero", "-o", tmp_path / "o.hlo",
                    env={"HLO_SHARD_MAX_INPUT_BYTES": "4M"}),
               message=r"^error: /dev/zero: input is larger than the limit of 4194304 bytes; "
                       r"raise it with HLO_SHARD_MAX_INPUT_BYTES")
    assert _listing(tmp_path) == []


def test_worker_memory_is_limited(tmp_path):
    big = tmp_path / "big.hlo"
    big.write_text(BIG)
    _one_error(_cli("verify", big, "--worker-memory", "1500M"),
               message=r"out of memory under the worker's limit of 1500 MiB; raise it with "
                       r"--worker-memory or HLO_SHARD_WORKER_MEMORY")


def test_worker_startup_is_bounded_by_timeout(spin):
    """1024 virtual devices take longer than a second to start (jax's import alone
    about does); the worker is stopped at --timeout, not after two minutes."""
    _one_error(_cli("verify", spin, "--devices", "1024", "--timeout", "1"),
               message=r"(starting jax|running .*): timed out after 1 s")


# ---------------------------------------------------------- 8. modes, hard links


def _invoke(args: list, umask: int):
    previous = os.umask(umask)
    try:
        return CliRunner().invoke(main, [str(a) for a in args])
    finally:
        os.umask(previous)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_outputs_get_the_umask_mode(umask, mode, tmp_path):
    result = _invoke(["optimize", SGD, "-o", tmp_path / "o.hlo", "--manifest",
                      tmp_path / "m.json"], umask)
    assert result.exit_code == 0, result.output
    for name in ("o.hlo", "m.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == mode, name


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o755])
def test_replaced_output_keeps_its_mode(mode, tmp_path):
    out = tmp_path / "o.hlo"
    out.write_text("old\n")
    out.chmod(mode)
    assert _invoke(["fmt", SGD, "-o", out], 0o077).exit_code == 0
    assert stat.S_IMODE(out.stat().st_mode) == mode and out.read_bytes() == _formatted()


def test_in_place_keeps_mode_and_hard_links(tmp_path):
    module = tmp_path / "m.hlo"
    module.write_bytes(SGD.read_bytes())
    module.chmod(0o644)
    alias = tmp_path / "alias.hlo"
    os.link(module, alias)
    inode = module.stat().st_ino
    assert _invoke(["optimize", module, "-o", module, "--in-place"], 0o077).exit_code == 0
    assert module.stat().st_ino == inode and module.stat().st_nlink == 2
    assert alias.read_bytes() == module.read_bytes() != SGD.read_bytes()
    assert stat.S_IMODE(module.stat().st_mode) == 0o644 and _listing(tmp_path) == [
        "alias.hlo", "m.hlo"]


def test_a_hard_link_of_the_input_is_the_input(tmp_path):
    module = tmp_path / "m.hlo"
    module.write_bytes(SGD.read_bytes())
    os.link(module, tmp_path / "alias.hlo")
    _one_error(_cli("fmt", module, "-o", tmp_path / "alias.hlo"), message=r"is an input")
    assert module.read_bytes() == SGD.read_bytes()


# ------------------------------------------------ 9. temporary files, 10. messages


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_are_cleaned_and_live_ones_kept(tmp_path):
    stale = tmp_path / f".o.hlo{TEMP_MARK}{_dead_pid()}-0123abcd"
    live = tmp_path / f".o.hlo{TEMP_MARK}{os.getpid()}-0123abcd"
    other = tmp_path / ".o.hlo.unrelated.tmp"
    for path in (stale, live, other):
        path.write_text("partial")
    _ok(_cli("fmt", SGD, "-o", tmp_path / "o.hlo"))
    assert _listing(tmp_path) == sorted([live.name, other.name, "o.hlo"])


def test_temporary_is_named_recognisably_and_removed_on_interruption(tmp_path, monkeypatch):
    import hlo_shard.outputs as outputs

    seen = []

    def interrupted_rename(source, target):
        seen.append(Path(source).name)
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs.os, "replace", interrupted_rename)
    handler = signal.getsignal(signal.SIGINT)  # the command ignores Ctrl-C once interrupted
    try:
        result = _invoke(["fmt", SGD, "-o", tmp_path / "o.hlo"], 0o022)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert result.exit_code == 130 and "error: interrupted" in result.output
    assert re.fullmatch(rf"\.o\.hlo{re.escape(TEMP_MARK)}{os.getpid()}-[0-9a-f]+", seen[0])
    assert _listing(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_folder_names_the_output(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        _one_error(_cli("fmt", SGD, "-o", folder / "o.hlo"),
                   message=rf"^error: {re.escape(str(folder / 'o.hlo'))}: Permission denied$")
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("command", [("fmt", SGD), ("report", SGD)], ids=lambda c: c[0])
def test_missing_folder_names_the_output(command, tmp_path):
    out = tmp_path / "missing" / "p.html"
    flag = "--html" if command[0] == "report" else "-o"
    line = _one_error(_cli(*command, flag, out),
                      message=rf"^error: {re.escape(str(out))}: No such file or directory$")
    assert TEMP_MARK not in line and ".tmp" not in line
    assert _listing(tmp_path) == []
