"""Comparing two modules' outputs, leaf by leaf and device by device.

A value matches when ``|candidate - original| <= atol + rtol·|original|`` elementwise
(numpy's ``isclose`` with the original as reference), NaNs sit at the same positions
and infinities agree exactly. Integer, pred and other non-float leaves must be equal.
Default tolerances depend on the element type: tight for f32/f64 (a rewrite that sums
in another order may still differ in the last bits), looser for 16- and 8-bit floats.

An output fed back to a parameter (a weight, an optimizer state) is also compared as
an *update*, ``Δ = out − in`` of each module (:func:`compare_update`): a weight is
``w + Δ`` with ``|Δ| ≪ |w|``, so an error in Δ hides under a tolerance relative to w.
Δ matches when ``|Δb − Δa| ≤ rtol_Δ·max|Δa| + 2·ulp(out)`` elementwise, max over the
leaf on all devices (docs/verify.md derives the bound from the reduction order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Sequence

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

#: Update tolerance per element type, relative to the leaf's largest update max|Δa|
#: (docs/verify.md: reduction order of N ≤ 256 addends, 256·u for f32/f64; 16-bit
#: and 8-bit state round every update, 4 units of their own roundoff).
DEFAULT_UPDATE_RTOL: dict[str, float] = {
    "f64": 256 * 2.0 ** -53, "f32": 256 * 2.0 ** -24, "f16": 4 * 2.0 ** -11,
    "bf16": 4 * 2.0 ** -8,
    **{t: 0.25 for t in FLOAT_TYPES if t.startswith("f8") or t.startswith("f4")},
}
#: ulps of the stored output each element may differ by: each module rounds its result
#: once (½ ulp each) and a differently fused last operation may round once more.
UPDATE_ULPS = 2.0
#: The most elements of a leaf an update check excuses as ill-conditioned (the share of
#: its elements): a slip moves far more, and a leaf where more of the original's own
#: updates are unstable is not excused at all.
EXCUSED_SHARE = 0.01


def update_rtol_for(element_type: str, rtol: float | None = None) -> float | None:
    """The update tolerance of ``element_type`` (None: not a float, no update check)."""
    default = DEFAULT_UPDATE_RTOL.get(element_type)
    return None if default is None else (default if rtol is None else rtol)


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
    #: "match" | "differ" | "update-differ" | "padding-nonzero" | "nan-mismatch" |
    #: "shape-mismatch" | "missing"
    verdict: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    #: Device with the largest error relative to the tolerance (None: no data).
    worst_device: int | None = None
    #: Elements out of tolerance, summed over devices, and elements compared.
    mismatched: int = 0
    compared: int = 0
    tolerance: Tolerance = EXACT
    detail: str = ""
    #: The update check (fed-back float leaves): largest |Δb − Δa|, it relative to
    #: max|Δa|, and the tolerance used (None: no update check on this leaf).
    update_max_abs: float = 0.0
    update_max_rel: float = 0.0
    update_rtol: float | None = None
    #: Padding lanes of the candidate's sharded output that are not zero, and checked.
    padding_nonzero: int = 0
    padding_checked: int = 0
    #: Elements out of the update tolerance that the original itself moves out of it
    #: under a one-ulp change of its inputs (:func:`compare_update`), summed over devices.
    excused: int = 0

    @property
    def ok(self) -> bool:
        return self.verdict == "match"

    def to_json(self) -> dict:
        return {"index": self.index, "shape": shape_text(self.shape), "verdict": self.verdict,
                "max_abs": self.max_abs, "max_rel": self.max_rel,
                "worst_device": self.worst_device, "mismatched": self.mismatched,
                "compared": self.compared, "rtol": self.tolerance.rtol,
                "atol": self.tolerance.atol, "detail": self.detail,
                "update": None if self.update_rtol is None else {
                    "max_abs": self.update_max_abs, "max_rel": self.update_max_rel,
                    "rtol": self.update_rtol, "ulps": UPDATE_ULPS},
                "padding": {"nonzero": self.padding_nonzero, "checked": self.padding_checked},
                "excused": self.excused}


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


# ------------------------------------------------------------------------- updates


def ulp(magnitude: np.ndarray, element_type: str) -> np.ndarray:
    """The spacing of ``element_type`` at each ``magnitude`` (float64), subnormals
    included: 2^(exponent − mantissa bits), at least the smallest subnormal."""
    from hlo_shard.runtime.inputs import numpy_dtype
    import ml_dtypes

    info = ml_dtypes.finfo(numpy_dtype(element_type))
    tiny, nmant = float(info.tiny), int(info.nmant)
    exponent = np.floor(np.log2(np.maximum(magnitude, tiny)))
    return np.maximum(np.exp2(exponent - nmant), float(info.smallest_subnormal))


def compare_update(leaf: LeafComparison, before_a: Sequence[np.ndarray],
                   after_a: Sequence[np.ndarray], before_b: Sequence[np.ndarray],
                   after_b: Sequence[np.ndarray], rtol: float | None = None,
                   nudged: tuple[Sequence[np.ndarray], Sequence[np.ndarray]] | None = None
                   ) -> LeafComparison:
    """``leaf`` (the value comparison) with the update check added: Δ = after − before
    of each module, per device; elements non-finite in either module are left to the
    value comparison. A failing update turns a matching leaf into "update-differ".

    The value check of a fed-back leaf is judged in the same terms: ``out = in + Δ``,
    so an element that misses the value tolerance (an output near zero by cancellation,
    ``w ≈ Δ``) passes when its error is within what each module's own state drift
    ``|in_b − in_a|`` (accepted at earlier steps) plus the update bound allow.

    ``nudged``: the original's (before, after) of this leaf run again on every float
    input one ulp further from zero. An element whose own Δ that moves out of the
    bound is ill-conditioned (its gradient a sum whose terms cancel, divided by a
    norm of its own size): no module computes it to within the bound from inputs
    known to an ulp, and one that sums in another order rounds it otherwise. Such
    elements out of the bound are excused (``excused``) where they are at most
    :data:`EXCUSED_SHARE` of the leaf's; never an element the nudge leaves stable."""
    element_type = leaf.shape.element_type
    tol = update_rtol_for(element_type, rtol)
    if tol is None or leaf.verdict in ("shape-mismatch", "missing"):
        return leaf
    devices = []
    for device, (ba, aa, bb, ab) in enumerate(zip(before_a, after_a, before_b, after_b)):
        a0, a1, b0, b1 = (np.asarray(v).astype(np.float64) for v in (ba, aa, bb, ab))
        finite = np.isfinite(a0) & np.isfinite(a1) & np.isfinite(b0) & np.isfinite(b1)
        with np.errstate(invalid="ignore", over="ignore"):
            da = np.where(finite, a1 - a0, 0.0)
            db = np.where(finite, b1 - b0, 0.0)
            drift = np.where(finite, np.abs(b0 - a0), 0.0)
            value_error = np.where(finite, np.abs(b1 - a1), 0.0)
            dn = da  # (not nudged: no element is unstable)
            if nudged is not None:
                n0, n1 = (np.asarray(v[device]).astype(np.float64) for v in nudged)
                dn = np.where(finite & np.isfinite(n0) & np.isfinite(n1), n1 - n0, da)
        # Non-finite elements the two modules disagree on: never excused here.
        disagree = int(np.count_nonzero(~finite & (a1 != b1) & ~(np.isnan(a1) & np.isnan(b1))))
        spacing = ulp(np.maximum(np.abs(np.where(finite, a1, 0.0)),
                                 np.abs(np.where(finite, b1, 0.0))), element_type)
        value_allowed = leaf.tolerance.atol + leaf.tolerance.rtol * np.abs(np.where(finite, a1, 0))
        devices.append((da, db, dn, spacing, drift, value_error, value_allowed, finite, disagree))
    scale = max((float(np.max(np.abs(d[0]))) for d in devices if d[0].size), default=0.0)
    worst_abs, worst_ratio, worst_device = 0.0, 0.0, leaf.worst_device
    outside: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    disagreeing = 0
    for device, (da, db, dn, spacing, drift, value_error, value_allowed, finite, disagree) in \
            enumerate(devices):
        disagreeing += disagree
        if not da.size:
            continue
        error = np.abs(db - da)
        allowed = tol * scale + UPDATE_ULPS * spacing
        value_outside = finite & (value_error > value_allowed) & (value_error > drift + allowed)
        outside.append((error > allowed, value_outside, np.abs(dn - da) > allowed))
        ratio = float(np.max(error / allowed))
        if ratio > worst_ratio:
            worst_ratio, worst_device = ratio, device
        worst_abs = max(worst_abs, float(np.max(error)))
    over, value_over, excused = _outside_counts(outside)
    value_over += disagreeing
    relative = worst_abs / scale if scale else (0.0 if not worst_abs else float("inf"))
    leaf = replace(leaf, update_max_abs=worst_abs, update_max_rel=relative, update_rtol=tol,
                   excused=excused)
    if leaf.verdict == "differ" and not value_over:
        leaf = replace(leaf, verdict="match", mismatched=0)
    if over and leaf.verdict == "match":
        leaf = replace(leaf, verdict="update-differ", mismatched=over, worst_device=worst_device,
                       detail=f"update Δ off by {worst_abs:.3g} ({relative:.3g} of max|Δ| "
                              f"{scale:.3g}; allowed {tol:g} of it + {UPDATE_ULPS:g} ulp)")
    return leaf


def _outside_counts(outside: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]
                    ) -> tuple[int, int, int]:
    """Elements out of the update bound and out of the value bound, and those of them
    excused (per device: update-outside, value-outside and unstable masks): the
    unstable ones where they are at most :data:`EXCUSED_SHARE` of the elements, else
    none."""
    elements = sum(update.size for update, _, _ in outside)
    excused = sum(int(np.count_nonzero((update | value) & unstable))
                  for update, value, unstable in outside)
    if excused > EXCUSED_SHARE * elements:
        excused = 0
    kept = [(update, value) if not excused else (update & ~unstable, value & ~unstable)
            for update, value, unstable in outside]
    return (sum(int(np.count_nonzero(update)) for update, _ in kept),
            sum(int(np.count_nonzero(value)) for _, value in kept), excused)


def nudged(values: np.ndarray) -> np.ndarray:
    """``values`` one ulp further from zero where they are finite floats other than
    zero and the largest (real float types, 8 to 64 bits, through their bit patterns:
    one more in the magnitude's bits is the next value out); the rest as they are."""
    import ml_dtypes

    values = np.asarray(values)
    if values.dtype.kind == "c":
        return values
    try:
        largest = float(ml_dtypes.finfo(values.dtype).max)
    except ValueError:  # not a float type
        return values
    wide = values.astype(np.float64)
    bits = values.view(np.dtype(f"u{values.dtype.itemsize}"))
    moves = np.isfinite(wide) & (wide != 0) & (np.abs(wide) < largest)
    return np.where(moves, bits + 1, bits).astype(bits.dtype).view(values.dtype)


def check_padding(leaf: LeafComparison, lanes: Sequence[np.ndarray]) -> LeafComparison:
    """``leaf`` with the padding check of a sharded output added: ``lanes`` holds the
    padding lanes of each replica group, which must be zero (neutral) every step."""
    checked = sum(int(np.size(v)) for v in lanes)
    bad = [np.asarray(v)[np.asarray(v) != 0] for v in lanes]
    nonzero = sum(int(b.size) for b in bad)
    leaf = replace(leaf, padding_nonzero=leaf.padding_nonzero + nonzero,
                   padding_checked=leaf.padding_checked + checked)
    if nonzero and leaf.verdict not in ("shape-mismatch", "missing"):
        example = next(b for b in bad if b.size)[0]
        leaf = replace(leaf, verdict="padding-nonzero",
                       detail=f"{nonzero} of {checked} padding lanes of the candidate's "
                              f"shards are not zero (e.g. {example!r})")
    return leaf
