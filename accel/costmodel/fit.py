"""The alpha-beta model of ``accel.costmodel.collectives`` fitted to measured all-reduces.

* ``fit_alpha_beta(sizes, seconds)``: one algorithm's line, fixed cost plus bytes over
  bandwidth;
* ``fit_steps_bytes(points, medium)``: one model for several algorithms at once (their latency
  terms and factors from ``terms``), with its relative error;
* ``measured_crossover(sizes, a_seconds, b_seconds)``: where one algorithm stops being faster
  than another in the timings, to set against ``crossover_bytes``' prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from accel import checks
from accel.costmodel.collectives import terms

__all__ = ["fit_alpha_beta", "StepsBytesFit", "fit_steps_bytes", "measured_crossover"]


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """The line ``seconds = alpha + size / bandwidth`` through measured points: returns
    ``(alpha, bandwidth)``, the fixed cost per call and the bytes per second the sizes move at.

    Sizes span decades (4 KiB to 64 MiB), so a plain least-squares line would follow the largest
    points and leave the intercept to their noise (even negative). The fit weighs each point by
    ``1 / seconds**2``: it minimises the RELATIVE error, so small messages fix ``alpha`` and
    large ones the bandwidth. A negative ``alpha`` is clipped to 0 (and the bandwidth refitted
    through the origin): a call cannot take less than no time."""
    sizes, seconds = [float(s) for s in sizes], [float(t) for t in seconds]
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need at least 2 (size, time) pairs of equal length, got "
                         f"{len(sizes)} sizes and {len(seconds)} times")
    if len(set(sizes)) < 2:
        raise ValueError(f"sizes must not all be equal, got {sizes}")
    if min(seconds) <= 0:
        raise ValueError(f"times must be > 0, got {seconds}")
    w = [1.0 / t**2 for t in seconds]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, sizes, strict=True)), \
        sum(wi * t for wi, t in zip(w, seconds, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes, strict=True))
    sxy = sum(wi * x * t for wi, x, t in zip(w, sizes, seconds, strict=True))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - slope * sx) / sw
    if alpha < 0:
        alpha, slope = 0.0, sxy / sxx
    if slope <= 0:
        raise ValueError(f"time does not grow with size (slope {slope:g}): cannot fit a "
                         "bandwidth")
    return alpha, 1.0 / slope


class StepsBytesFit(NamedTuple):
    """``fit_steps_bytes``' answer: the fixed seconds of every all-reduce (``call``), the
    seconds per latency term (``alpha``: a step on links, a message on a shared medium), the
    bandwidth in bytes per second, and the root-mean-square relative error of the fit."""
    call: float
    alpha: float
    bandwidth: float
    rel_error: float


def fit_steps_bytes(points: Sequence[tuple[str, int, float, float]], medium: str = "links"
                    ) -> StepsBytesFit:
    """Fit the model to measured all-reduces of several algorithms at once.

    ``points`` are ``(algorithm, n, nbytes, seconds)``; the fit is ``seconds = call +
    latency_terms * alpha + factor * nbytes / bandwidth`` with ``(latency_terms, factor) =
    terms(algorithm, n, medium)`` and one fixed ``call`` cost shared by every algorithm.
    Like ``fit_alpha_beta`` it minimises the relative error; a coefficient that would come out
    negative is held at 0 (the best fit among those that keep every coefficient >= 0).
    ``crossover_bytes(a, b, n, fit.alpha, fit.bandwidth, medium)`` then predicts where two
    algorithms swap places (``call`` cancels out), and ``rel_error`` says how well the medium
    explains the points."""
    import numpy as np

    rows, times = [], []
    for point in points:
        if len(point) != 4:
            raise ValueError(f"each point must be (algorithm, n, nbytes, seconds), got {point!r}")
        alg, n, nbytes, seconds = point
        steps, factor = terms(alg, n, medium)
        checks.non_negative_number("nbytes", nbytes)
        if not seconds > 0:
            raise ValueError(f"times must be > 0, got {seconds!r}")
        rows.append([1.0, steps, factor * nbytes])
        times.append(float(seconds))
    a = np.array(rows) / np.array(times)[:, None] if rows else np.zeros((0, 3))
    if len(times) < 3 or np.linalg.matrix_rank(a) < 3:
        raise ValueError("need points of at least two algorithms with different step counts "
                         "and at least two sizes to separate call, alpha and bandwidth, got "
                         f"{len(times)} points")
    target = np.ones(len(times))
    best = None
    for mask in range(1, 8):  # every non-empty set of free coefficients; the others held at 0
        free = [i for i in range(3) if mask >> i & 1]
        x = np.zeros(3)
        x[free] = np.linalg.lstsq(a[:, free], target, rcond=None)[0]
        if (x < 0).any():
            continue
        err = float(np.sum((a @ x - target) ** 2))
        if best is None or err < best[0]:
            best = (err, x)
    if best is None or best[1][2] <= 0:
        raise ValueError("time does not grow with bytes: cannot fit a bandwidth")
    err, (call, alpha, per_byte) = best
    return StepsBytesFit(float(call), float(alpha), float(1.0 / per_byte),
                         math.sqrt(err / len(times)))


def measured_crossover(sizes: Sequence[float], a_seconds: Sequence[float],
                       b_seconds: Sequence[float]) -> float:
    """The size at which algorithm ``a`` stops being faster than ``b`` in measured timings:
    the first place, going up in size, where ``a``'s time goes from below ``b``'s to above it,
    interpolated linearly in log size and log ratio. ``0.0`` if ``a`` is not faster at the
    smallest size, ``math.inf`` if it is faster at every size."""
    if not len(sizes) == len(a_seconds) == len(b_seconds) or len(sizes) < 1:
        raise ValueError(f"need equally many sizes and times, got {len(sizes)}, "
                         f"{len(a_seconds)} and {len(b_seconds)}")
    pts = sorted(zip(sizes, a_seconds, b_seconds, strict=True))
    if min(min(p[1], p[2]) for p in pts) <= 0 or pts[0][0] <= 0:
        raise ValueError("sizes and times must be > 0")
    logs = [(math.log(s), math.log(ta / tb)) for s, ta, tb in pts]
    if logs[0][1] >= 0:
        return 0.0
    for (x0, r0), (x1, r1) in zip(logs[:-1], logs[1:], strict=True):
        if r1 >= 0:
            return math.exp(x0 + (x1 - x0) * (-r0) / (r1 - r0))
    return math.inf
