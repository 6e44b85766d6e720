"""The alpha-beta (latency-bandwidth) model of an all-reduce, and what follows from it.

Every message costs ``alpha`` seconds of latency plus its bytes over the link's bandwidth. An
all-reduce of ``S`` bytes over ``n`` devices then takes ``steps * alpha + factor * S / bw``,
where ``steps`` and ``factor`` depend only on the algorithm (``terms``):

===============  =====================  ==============================================
algorithm        steps (latency terms)  factor (bytes on the busiest link, / S)
===============  =====================  ==============================================
``one_device``   2                      ``2 (n - 1)``: the root receives and sends n-1 copies
``direct``       1                      ``n - 1``: each device sends its tensor to n-1 others
``ring``         ``2 (n - 1)``          ``2 (n - 1) / n``: 2(n-1) chunks of S/n
``tree``         ``2 d``                ``2 d f``: d = tree depth, f = children per node (<=2)
===============  =====================  ==============================================

Few steps win for small messages (latency), the ring's small factor for big ones (bandwidth);
``crossover_bytes`` is the size where two algorithms cost the same. The bandwidths the course
quotes are NVIDIA's nccl-tests definitions (``doc/PERFORMANCE.md`` in github.com/NVIDIA/nccl-tests):
*algorithm bandwidth* = ``S / time``; *bus bandwidth* = algorithm bandwidth times
``2 (n - 1) / n`` for an all-reduce, a figure that can be compared with the link's peak whatever
``n`` is. Everything here is a MODEL (arithmetic on figures you pass), never a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from accel import checks

__all__ = ["ALGORITHMS", "MEDIA", "StepsBytesFit", "terms", "allreduce_time", "crossover_bytes",
           "algorithm_bandwidth",
           "bus_bandwidth", "BUS_FACTORS", "fit_alpha_beta", "fit_steps_bytes",
           "measured_crossover", "sharded_ps_time",
           "packed_time", "local_sgd_step_time", "overlapped_step_time", "SEED_2016"]

ALGORITHMS = ("one_device", "direct", "ring", "tree")
MEDIA = ("links", "shared")

# collective -> bus-bandwidth factor as a function of n (nccl-tests doc/PERFORMANCE.md)
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}

# Seed 002's figures (notes on A. Geron, "Hands-On Machine Learning with Scikit-Learn and
# TensorFlow", 1st ed., 2017, ch. 12, reporting Google's 2016 experience): with the hardware
# and networks of 2016, data parallelism saturated the bandwidth beyond a few dozen GPUs for
# dense models and a few hundred for sparse ones; sparse models that still scaled:
SEED_2016 = {
    "saturates (dense)": "beyond a few dozen GPUs",
    "saturates (sparse)": "beyond a few hundred GPUs",
    "neural machine translation": (8, 6.0),    # GPUs, speed-up
    "Inception / ImageNet": (50, 32.0),
    "RankBrain": (500, 300.0),
}


def _check_n(n: int) -> int:
    return checks.positive_int("n", n)


def terms(algorithm: str, n: int, medium: str = "links") -> tuple[float, float]:
    """``(steps, factor)``: the all-reduce of ``S`` bytes on ``n`` devices costs
    ``steps * alpha + factor * S / bandwidth``.

    ``medium="links"`` (the table above): every device has its own link and the links run in
    parallel, so the busiest link sets the time. ``medium="shared"``: one medium carries every
    byte in turn (processes on one machine's loopback, sharing its cores and memory), so the
    factor is the total all devices send: ``2 (n - 1)`` for ``one_device``, ``ring`` and
    ``tree`` alike, ``n (n - 1)`` for ``direct``."""
    checks.one_of("algorithm", algorithm, ALGORITHMS)
    checks.one_of("medium", medium, MEDIA)
    n = _check_n(n)
    if n == 1:
        return 0.0, 0.0
    if medium == "shared":
        steps = terms(algorithm, n)[0]
        return steps, float(n * (n - 1) if algorithm == "direct" else 2 * (n - 1))
    if algorithm == "one_device":
        return 2.0, 2.0 * (n - 1)
    if algorithm == "direct":
        return 1.0, float(n - 1)
    if algorithm == "ring":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    depth = n.bit_length() - 1
    fanout = min(2, n - 1)
    return 2.0 * depth, 2.0 * depth * fanout


def allreduce_time(nbytes: float, n: int, algorithm: str, latency_s: float,
                   bandwidth_bps: float, medium: str = "links") -> float:
    """Modelled seconds of one all-reduce of ``nbytes`` over ``n`` devices."""
    checks.non_negative_number("nbytes", nbytes)
    checks.non_negative_number("latency_s", latency_s)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    steps, factor = terms(algorithm, n, medium)
    return steps * latency_s + factor * nbytes / bandwidth_bps


def crossover_bytes(a: str, b: str, n: int, latency_s: float, bandwidth_bps: float,
                    medium: str = "links") -> float:
    """Message size (bytes) where algorithms ``a`` and ``b`` take the same modelled time, or
    ``math.inf`` if the lines never cross at a positive size (one is never slower)."""
    checks.positive_number("latency_s", latency_s)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    sa, fa = terms(a, n, medium)
    sb, fb = terms(b, n, medium)
    if fa == fb:
        return math.inf
    size = (sa - sb) * latency_s * bandwidth_bps / (fb - fa)
    return size if size > 0 else math.inf


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: ``nbytes / seconds`` (bytes per second)."""
    checks.non_negative_number("nbytes", nbytes)
    return nbytes / checks.positive_number("seconds", seconds)


def bus_bandwidth(nbytes: float, seconds: float, n: int, collective: str = "all_reduce"
                  ) -> float:
    """nccl-tests' bus bandwidth: algorithm bandwidth times the collective's factor
    (``2 (n-1)/n`` for an all-reduce)."""
    checks.one_of("collective", collective, BUS_FACTORS)
    return algorithm_bandwidth(nbytes, seconds) * BUS_FACTORS[collective](_check_n(n))


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
    """``fit_steps_bytes``' answer: seconds per call, per step (alpha), the bandwidth in bytes
    per second, and the root-mean-square relative error of the fitted times."""
    call: float
    alpha: float
    bandwidth: float
    rel_error: float


def fit_steps_bytes(points: Sequence[tuple[str, int, float, float]], medium: str = "links"
                    ) -> StepsBytesFit:
    """Fit the model to measured all-reduces of several algorithms at once.

    ``points`` are ``(algorithm, n, nbytes, seconds)``; the fit is ``seconds = call +
    steps * alpha + factor * nbytes / bandwidth`` with ``(steps, factor) = terms(algorithm,
    n, medium)`` and one ``call`` cost shared by every algorithm (launching the function).
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


def sharded_ps_time(nbytes: float, workers: int, servers: int, latency_s: float,
                    bandwidth_bps: float) -> float:
    """One synchronous exchange with parameter servers on their own machines (chapter 10's
    placement): every worker sends its ``nbytes`` of gradients and fetches ``nbytes`` of
    weights; the variables are sharded evenly over ``servers`` tasks, so each server's link
    carries ``workers * nbytes / servers`` each way, each worker's link ``nbytes``. The busier
    link sets the time: ``2 (alpha + max(nbytes, workers * nbytes / servers) / bw)``."""
    checks.non_negative_number("nbytes", nbytes)
    checks.positive_int("workers", workers)
    checks.positive_int("servers", servers)
    checks.non_negative_number("latency_s", latency_s)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    busiest = max(nbytes, workers * nbytes / servers)
    return 2 * (latency_s + busiest / bandwidth_bps)


def packed_time(sizes: Sequence[float], pack_bytes: float, n: int, algorithm: str,
                latency_s: float, bandwidth_bps: float) -> float:
    """Modelled time to all-reduce tensors of ``sizes`` bytes packed greedily, in order, into
    buckets of at most ``pack_bytes`` (a tensor bigger than that gets its own bucket);
    ``pack_bytes=0`` means one all-reduce per tensor."""
    checks.non_negative_number("pack_bytes", pack_bytes)
    buckets, current = [], 0.0
    for s in sizes:
        s = checks.non_negative_number("size", s)
        if current and current + s > pack_bytes:
            buckets.append(current)
            current = 0.0
        current += s
        if pack_bytes == 0:
            buckets.append(current)
            current = 0.0
    if current:
        buckets.append(current)
    return sum(allreduce_time(b, n, algorithm, latency_s, bandwidth_bps) for b in buckets)


def local_sgd_step_time(compute_s: float, allreduce_s: float, every: int) -> float:
    """Average step time when the replicas average their weights only every ``every`` steps
    (local SGD): ``compute_s + allreduce_s / every``."""
    checks.non_negative_number("compute_s", compute_s)
    checks.non_negative_number("allreduce_s", allreduce_s)
    return compute_s + allreduce_s / checks.positive_int("every", every)


def overlapped_step_time(forward_s: float, backward_s: float, allreduce_s: float,
                         buckets: int = 1) -> float:
    """Step time when gradients are all-reduced in ``buckets`` equal buckets, each sent as
    soon as the backward pass has produced it: the longer of backward and communication
    hides the shorter one, except one bucket's worth that cannot overlap. ``buckets=1`` is no
    overlap: ``forward + backward + allreduce``."""
    checks.non_negative_number("forward_s", forward_s)
    checks.non_negative_number("backward_s", backward_s)
    checks.non_negative_number("allreduce_s", allreduce_s)
    b = checks.positive_int("buckets", buckets)
    if b == 1:
        return forward_s + backward_s + allreduce_s
    return forward_s + max(backward_s, allreduce_s) + min(backward_s, allreduce_s) / b
