"""Comparing two modules' outputs, leaf by leaf and device by device.

A value matches when ``|candidate - original| <= atol + rtol·|original|`` elementwise
(numpy's ``isclose`` with the original as reference), NaNs sit at the same positions
and infinities agree exactly. Integer, pred and other non-float leaves must be equal.
Default tolerances depend on the element type: tight for f32/f64 (a rewrite that sums
in another order may still differ in the last bits), looser for 16- and 8-bit floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hlo_shard.ir import ArrayShape, COMPLEX_TYPES, FLOAT_TYPES


@dataclass(frozen=True, slots=True)
class Tolerance:
    rtol: float
    atol: float


#: Per element type; anything not listed (ints, pred) compares exactly.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "f64": Tolerance(1e-12, 1e-14), "c128": Tolerance(1e-12, 1e-14),
    "f32": Tolerance(1e-5, 1e-6), "c64": Tolerance(1e-5, 1e-6),
    "f16": Tolerance(1e-3, 1e-4), "bf16": Tolerance(1e-2, 1e-3),
    **{t: Tolerance(1.3e-1, 1e-2) for t in FLOAT_TYPES if t.startswith("f8") or t.startswith("f4")},
}
EXACT = Tolerance(0.0, 0.0)


def tolerance_for(element_type: str, rtol: float | None = None,
                  atol: float | None = None) -> Tolerance:
    """The default for ``element_type`` with the user's overrides (floats only: ints
    and pred always compare exactly)."""
    default = DEFAULT_TOLERANCES.get(element_type)
    if default is None:
        return EXACT
    return Tolerance(default.rtol if rtol is None else rtol,
                     default.atol if atol is None else atol)


@dataclass(frozen=True, slots=True)
class LeafComparison:
    """The verdict for one output leaf over all devices."""

    index: int
    shape: ArrayShape
    verdict: str  # "match" | "differ" | "nan-mismatch" | "shape-mismatch" | "missing"
    max_abs: float = 0.0
    max_rel: float = 0.0
    #: Device with the largest error relative to the tolerance (None: no data).
    worst_device: int | None = None
    #: Elements out of tolerance, summed over devices, and elements compared.
    mismatched: int = 0
    compared: int = 0
    tolerance: Tolerance = EXACT
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "match"

    def to_json(self) -> dict:
        return {"index": self.index, "shape": shape_text(self.shape), "verdict": self.verdict,
                "max_abs": self.max_abs, "max_rel": self.max_rel,
                "worst_device": self.worst_device, "mismatched": self.mismatched,
                "compared": self.compared, "rtol": self.tolerance.rtol,
                "atol": self.tolerance.atol, "detail": self.detail}


def shape_text(shape: ArrayShape) -> str:
    """``f32[3,4]``: element type and dims, no layout (for tables and messages)."""
    return f"{shape.element_type}[{','.join(map(str, shape.dims))}]"


@dataclass(frozen=True, slots=True)
class _DeviceError:
    max_abs: float
    max_rel: float
    worst_ratio: float
    mismatched: int
    nan_mismatch: bool


def _device_error(original: np.ndarray, candidate: np.ndarray, tol: Tolerance,
                  inexact: bool) -> _DeviceError:
    if not inexact:
        differ = original != candidate
        count = int(np.count_nonzero(differ))
        if not count:
            return _DeviceError(0.0, 0.0, 0.0, 0, False)
        wide_a, wide_b = original.astype(np.float64), candidate.astype(np.float64)
        max_abs = float(np.max(np.abs(wide_a - wide_b)))
        rel = np.abs(wide_a - wide_b)[differ] / np.maximum(np.abs(wide_a[differ]), 1)
        return _DeviceError(max_abs, float(np.max(rel)), float("inf"), count, False)
    wide = np.complex128 if np.iscomplexobj(original) else np.float64
    a, b = original.astype(wide), candidate.astype(wide)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    nan_mismatch = bool(np.any(nan_a != nan_b))
    finite = ~(nan_a | nan_b)
    inf_differ = finite & (np.isinf(a) | np.isinf(b)) & (a != b)
    both_finite = finite & np.isfinite(a) & np.isfinite(b)
    diff = np.abs(np.subtract(a, b, where=both_finite, out=np.zeros_like(a)))
    scale = np.abs(a)
    allowed = tol.atol + tol.rtol * scale
    over = both_finite & (diff > allowed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(both_finite, diff / np.where(allowed > 0, allowed, 1.0), 0.0)
        rel = np.where(both_finite & (scale > 0), diff / np.where(scale > 0, scale, 1.0), 0.0)
    mismatched = int(np.count_nonzero(over | inf_differ | (nan_a != nan_b)))
    worst = float(np.max(ratio)) if ratio.size else 0.0
    if np.any(inf_differ) or nan_mismatch:
        worst = float("inf")
    return _DeviceError(float(np.max(diff)) if diff.size else 0.0,
                        float(np.max(rel)) if rel.size else 0.0, worst, mismatched,
                        nan_mismatch)


def compare_leaf(index: int, shape: ArrayShape, original: Sequence[np.ndarray],
                 candidate: Sequence[np.ndarray], rtol: float | None = None,
                 atol: float | None = None) -> LeafComparison:
    """Compare one output leaf given per device (``original[d]``, ``candidate[d]``)."""
    tol = tolerance_for(shape.element_type, rtol, atol)
    for device, (a, b) in enumerate(zip(original, candidate)):
        if np.shape(a) != np.shape(b):
            return LeafComparison(index, shape, "shape-mismatch", worst_device=device,
                                  tolerance=tol, detail=f"device {device}: original "
                                  f"{np.shape(a)} vs candidate {np.shape(b)}")
    inexact = shape.element_type in FLOAT_TYPES | COMPLEX_TYPES
    errors = [_device_error(np.asarray(a), np.asarray(b), tol, inexact)
              for a, b in zip(original, candidate)]
    compared = sum(int(np.size(a)) for a in original)
    if not errors:
        return LeafComparison(index, shape, "match", tolerance=tol)
    worst = max(range(len(errors)), key=lambda d: (errors[d].worst_ratio, errors[d].max_abs))
    mismatched = sum(e.mismatched for e in errors)
    if any(e.nan_mismatch for e in errors):
        verdict = "nan-mismatch"
    else:
        verdict = "differ" if mismatched else "match"
    return LeafComparison(
        index, shape, verdict, max(e.max_abs for e in errors), max(e.max_rel for e in errors),
        worst, mismatched, compared, tol)


def missing_leaf(index: int, shape: ArrayShape, why: str) -> LeafComparison:
    return LeafComparison(index, shape, "missing", detail=why)
