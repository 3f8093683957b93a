"""XLA's own parser as the oracle of the fuzz and hostile-input tests.

:func:`xla_parse` reads texts with ``xc.hlo.hlo_module_from_text`` (jax's private API,
the reference hlo-shard's front end must agree with) in a child process: XLA's parser
aborts the whole process on some inputs (a CHECK failure), which must not take pytest
with it. The other test modules import it from here; the tests below check the oracle.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import NamedTuple

_CHILD = r"""
import pickle, sys
from jax._src.lib import xla_client as xc
results = []
for text in pickle.load(sys.stdin.buffer):
    try:
        results.append(("ok", xc.hlo.hlo_module_from_text(text).to_string()))
    except Exception as err:
        results.append(("error", str(err)))
pickle.dump(results, sys.stdout.buffer)
"""


class XlaVerdict(NamedTuple):
    #: "ok" (parsed), "error" (refused) or "abort" (XLA's parser killed its process).
    status: str
    #: ``HloModule.to_string()`` when parsed, else the error or the abort message.
    text: str

    @property
    def accepted(self) -> bool | None:
        return None if self.status == "abort" else self.status == "ok"


def xla_parse(texts: list[str], timeout: float = 600) -> list[XlaVerdict]:
    """XLA's verdict on each text, in one child process (split in halves around texts
    that abort it, so that one abort costs only its own verdict)."""
    if not texts:
        return []
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps(texts),
                          capture_output=True, timeout=timeout)
    if proc.returncode == 0:
        return [XlaVerdict(*result) for result in pickle.loads(proc.stdout)]
    if len(texts) == 1:
        fatal = [line for line in proc.stderr.decode(errors="replace").splitlines()
                 if line.startswith("F")]
        return [XlaVerdict("abort", fatal[0] if fatal else f"exit status {proc.returncode}")]
    half = len(texts) // 2
    return xla_parse(texts[:half], timeout) + xla_parse(texts[half:], timeout)


def test_oracle_parses_refuses_and_survives_aborts():
    good = "HloModule m\nENTRY e { ROOT c = f32[2] constant({1, 2}) }\n"
    bad = "HloModule m\nENTRY e { ROOT c = f32[2] frobnicate() }\n"
    aborting = "HloModule m\nENTRY e { ROOT c = f32[] constant(true) }\n"
    verdicts = xla_parse([good, bad, aborting, good])
    assert [v.status for v in verdicts] == ["ok", "error", "abort", "ok"]
    assert "constant({1, 2})" in verdicts[0].text and verdicts[0] == verdicts[3]
    assert "frobnicate" in verdicts[1].text and "not PRED" in verdicts[2].text
    assert [v.accepted for v in verdicts] == [True, False, None, True]
