"""hlo-shard inside JAX programs (the only package besides ``runtime`` that uses jax's
private API, behind the version check). ``install()``: the pass inside XLA's
compilation of every ``jax.jit`` step, zero code change."""

from hlo_shard.jax.hook import Decision, decisions, install, installed, uninstall

__all__ = ["Decision", "decisions", "install", "installed", "uninstall"]
