"""Imports go one way (CONTRIBUTING's layout): every module of ``hlo_shard/`` is read (its
source, with the imports inside functions), and an import of a unit in a higher layer, or
of another unit in the same layer, fails with the line that makes it. A unit is a top-level
module or subpackage; a new one must be placed in :data:`LAYERS` before its imports pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hlo_shard"

#: Lowest first. A unit may import itself and any unit of a lower layer; units that share
#: a layer are independent of each other. ``hlo_shard`` is the package's ``__init__``.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "units", "_grammar_tables"),
    ("limits", "outputs", "dumps"),
    ("source",),
    ("schema",),
    ("ir",),
    ("opinfo", "values", "attributes", "shard_format"),
    ("graph", "profiles"),
    ("printer",),
    ("parser", "validate"),
    ("analysis",),
    ("costmodel",),
    ("passes",),
    # The package's face: the records, the parser and printer, and the optimizer's one
    # entry point (``hlo_shard.optimize``).
    ("hlo_shard",),
    ("runtime", "scaling"),
    # The library's front end and the cost reports of the CLI's commands: neither uses
    # the other (jax/_program once imported the reports' fmt_seconds: now units).
    ("jax", "reports"),
    ("cli",),
    ("fuzz", "__main__"),
)
LAYER = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """``hlo_shard.passes.base`` → ``passes``; the package itself → ``hlo_shard``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every ``hlo_shard`` module ``source`` imports: ``from A import b``
    names ``A.b`` where that is a module, else ``A``; relative imports resolved."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            found += [(node.lineno, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}")
                       else base) for alias in node.names]
    return [(line, name) for line, name in found
            if name == "hlo_shard" or name.startswith("hlo_shard.")]


def layering_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """What in ``source`` (the text of ``module``) imports upward or sideways."""
    unit = _unit(module)
    wrong = []
    for line, name in imported_modules(module, source, is_package):
        target = _unit(name)
        if target != unit and LAYER[target] >= LAYER[unit]:
            way = "sideways" if LAYER[target] == LAYER[unit] else "upward"
            wrong.append(f"{module}:{line}: imports {name} ({unit} -> {target}, {way})")
    return wrong


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {_unit(_module_name(path)) for path in _modules()}
    assert units - set(LAYER) == set(), "place these in LAYERS"
    assert set(LAYER) - units == set(), "LAYERS names units that no longer exist"


def _every_module(check) -> list[str]:
    """What ``check(module, source, is_package)`` reports over every module of the package."""
    return [message for path in _modules()
            for message in check(_module_name(path), path.read_text(), path.name == "__init__.py")]


def test_no_module_imports_upward_or_sideways():
    wrong = _every_module(layering_violations)
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_the_imports_it_forbids():
    """The imports this test was written to remove, as they were: each is reported."""
    assert layering_violations("hlo_shard.jax._capture",
                               "from hlo_shard.cli.optimize import pick_dump_file\n") == [
        "hlo_shard.jax._capture:1: imports hlo_shard.cli.optimize (jax -> cli, upward)"]
    lazy = "def measure():\n    from hlo_shard import runtime\n"
    assert layering_violations("hlo_shard.profiles.calibrate", lazy) == [
        "hlo_shard.profiles.calibrate:2: imports hlo_shard.runtime (profiles -> runtime, upward)"]
    relative = "from ..reports.content import fmt_seconds\n"
    assert layering_violations("hlo_shard.jax._program", relative) == [
        "hlo_shard.jax._program:1: imports hlo_shard.reports.content (jax -> reports, sideways)"]
    assert layering_violations("hlo_shard.passes.speed_gate", relative) == [
        "hlo_shard.passes.speed_gate:1: imports hlo_shard.reports.content "
        "(passes -> reports, upward)"]
    assert layering_violations("hlo_shard.cli.optimize", "from hlo_shard.units import fmt_seconds\n"
                               "from . import app\n") == []


#: Packages whose modules are internals: outside the package only its ``__init__`` (the
#: face it exports) may be imported.
SEALED_PACKAGES = ("hlo_shard.passes.weight_update",)


def face_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """What in ``source`` imports a sealed package's internals from outside it."""
    wrong = []
    for line, name in imported_modules(module, source, is_package):
        for sealed in SEALED_PACKAGES:
            inside = module == sealed or module.startswith(sealed + ".")
            if name.startswith(sealed + ".") and not inside:
                wrong.append(f"{module}:{line}: imports {name} (use {sealed}'s face)")
    return wrong


def test_other_modules_use_only_the_weight_update_face():
    wrong = _every_module(face_violations)
    assert not wrong, "\n".join(wrong)


def test_the_face_check_sees_an_internal_import():
    """tuple_forwarding and channel_dedupe imported the pass's internals, as they did."""
    internal = "from hlo_shard.passes.weight_update.emit import ChannelIds\n"
    assert face_violations("hlo_shard.passes.channel_dedupe", internal) == [
        "hlo_shard.passes.channel_dedupe:1: imports hlo_shard.passes.weight_update.emit "
        "(use hlo_shard.passes.weight_update's face)"]
    assert face_violations("hlo_shard.passes.weight_update.lowering", internal) == []
    assert face_violations("hlo_shard.passes.channel_dedupe",
                           "from hlo_shard.passes.weight_update import ChannelIds\n") == []
