"""The parser keeps no cache file: nothing is written to the temp folder, and a file
planted where lark's own cache (``cache=True``) would be is never read (unpickling it
would run whatever the planter put there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PARSE = (
    "from hlo_shard import parse\n"
    "parse('HloModule m\\nENTRY e {\\n  ROOT p = f32[4] parameter(0)\\n}\\n')\n"
)

#: Writes lark's cache file where the parser's former ``Lark(..., cache=True)`` read it:
#: the file name hashes the grammar and the options in the order they were given.
_WRITE_LARK_CACHE = (
    "from lark import Lark\n"
    "from hlo_shard.parser import grammar_path\n"
    "Lark(grammar_path().read_text(encoding='utf-8'), parser='lalr', lexer='contextual',\n"
    "     start=['start', 'inline_body'], maybe_placeholders=True, cache=True)\n"
)


def _run(code: str, tmpdir: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT),
           "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT, timeout=120)


def test_parsing_writes_nothing_to_the_temp_folder(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    _run(_PARSE, tmpdir)
    assert list(tmpdir.iterdir()) == []


class _Planted:
    """Unpickling it creates the marker file (what a hostile pickle could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_file_planted_under_lark_cache_name_is_never_loaded(tmp_path):
    import pickle

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    _run(_WRITE_LARK_CACHE, tmpdir)
    (cache,) = tmpdir.glob(".lark_cache_*")
    marker = tmp_path / "planted-code-ran"
    header = cache.read_bytes().split(b"\n", 1)[0]  # lark's key line, kept
    cache.write_bytes(header + b"\n" + pickle.dumps(_Planted(marker)))
    _run(_PARSE, tmpdir)
    assert not marker.exists()


def test_shipped_grammar_tables_are_current():
    """Else every process builds the tables from the grammar text (a large part of a
    second): run ``python scripts/grammar_tables.py``. (A lark version other than the
    one they were made with also makes the parser build them: only slower.)"""
    from hlo_shard import _grammar_tables
    from hlo_shard.parser import grammar_digest

    assert _grammar_tables.DIGEST == grammar_digest()


def test_tables_of_another_lark_version_are_not_loaded(monkeypatch):
    from hlo_shard import _grammar_tables, parser

    monkeypatch.setattr(_grammar_tables, "LARK_VERSION", "0.0-other")
    monkeypatch.setattr(parser, "_TABLES", None)
    assert parser._grammar_tables() is not _grammar_tables.TABLES
    monkeypatch.setattr(_grammar_tables, "LARK_VERSION", __import__("lark").__version__)
    monkeypatch.setattr(parser, "_TABLES", None)
    assert parser._grammar_tables() is _grammar_tables.TABLES
