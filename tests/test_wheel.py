"""The built wheel carries the grammar: install it in a fresh venv and run ``fmt``."""

from __future__ import annotations

import importlib.util
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    run = subprocess.run(list(args), capture_output=True, text=True, timeout=600, **kwargs)
    assert run.returncode == 0, f"{' '.join(args)}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def _source_copy(target: Path) -> Path:
    """The checkout's files as git sees them (tracked and not ignored), so the build
    neither writes into the shared checkout nor picks up build leftovers."""
    listing = _run("git", "ls-files", "-co", "--exclude-standard", "-z", cwd=ROOT).stdout
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file() and not name.startswith(("fixtures/", "bench/")):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not (ROOT / "README.md").is_file():
        pytest.fail("README.md is missing: pyproject.toml names it as the readme, so "
                    "no wheel can be built")
    src = _source_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(out),
         str(src))
    (built,) = out.glob("hlo_shard-*.whl")
    return built


def test_wheel_contains_the_grammar(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "hlo_shard/grammar/hlo.lark" in names
    assert "hlo_shard/parser.py" in names


def test_installed_wheel_formats_a_fixture(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    venv_site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                             "['purelib'])").stdout.strip())
    # lark, click, networkx, jax... come from this interpreter's site-packages.
    (venv_site / "_host_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel))

    fixtures = sorted(ROOT.glob("fixtures/**/*.hlo")) or [ROOT / "tests/golden/control_flow.hlo"]
    case = fixtures[0]
    work = tmp_path / "elsewhere"  # away from the checkout: only the wheel can be found
    work.mkdir()
    where = _run(str(python), "-c", "import hlo_shard.parser as p; print(p.grammar_path())",
                 cwd=work).stdout.strip()
    assert Path(where).is_relative_to(venv_site), where
    out = work / "out.hlo"
    _run(str(venv / "bin" / "hlo-shard"), "fmt", str(case), "-o", str(out), cwd=work)

    sys.path.insert(0, str(ROOT))
    from hlo_shard import parse, to_text

    assert out.read_text() == to_text(parse(case.read_text()))
