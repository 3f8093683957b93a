"""The ``hlo-shard`` command line.

Every command goes through :func:`hlo_shard.cli.app.user_errors`: a user error (bad
input, bad flags, an XLA failure) becomes one ``error:`` line on stderr (with the
source line and a caret for parse errors) and exit status 2 — never a traceback,
never a partial output file. Each command lives in its own module of this package
and registers itself on :data:`main`; jax is imported only by the commands that
execute modules, inside the command.
"""

from __future__ import annotations

import importlib
import pkgutil

from hlo_shard.cli.app import main

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "app":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["main"]
