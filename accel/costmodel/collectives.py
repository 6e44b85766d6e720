"""The alpha-beta (latency-bandwidth) model of an all-reduce, and what follows from it.

Every message costs ``alpha`` seconds of latency plus its bytes over the link's bandwidth. An
all-reduce of ``S`` bytes over ``n`` devices then takes ``steps * alpha + factor * S / bw``,
where ``steps`` and ``factor`` depend only on the algorithm (``terms``). ``steps`` counts the
messages that must follow one another; ``factor * S`` is the bytes the busiest device's link
carries one after another. Each device has a link of its own, which sends and receives at the
same time but carries one message at a time in each direction:

===============  =====================  ==============================================
algorithm        steps (latency terms)  factor (bytes the busiest link carries, / S)
===============  =====================  ==============================================
``one_device``   2                      ``2 (n - 1)``: the root receives n-1 copies, then
                                        sends n-1
``direct``       1                      ``n - 1``: each device sends its tensor to n-1
                                        others while it receives theirs
``ring``         ``2 (n - 1)``          ``2 (n - 1) / n``: 2(n-1) chunks of S/n, each step
                                        sending one and receiving one
``tree``         ``2 d``                ``2 d f``: d = tree depth, f = children per node
                                        (<= 2), received one by one going up, sent one by
                                        one going down
===============  =====================  ==============================================

Few steps win for small messages (latency), the ring's small factor for big ones (bandwidth);
``crossover_bytes`` is the size where two algorithms cost the same. ``medium="shared"`` is the
other picture: no link per device, one machine that carries every message and every byte in
turn (processes on one machine's loopback). The bandwidths the course quotes are NVIDIA's
nccl-tests definitions (``doc/PERFORMANCE.md`` in github.com/NVIDIA/nccl-tests):
*algorithm bandwidth* = ``S / time``; *bus bandwidth* = algorithm bandwidth times
``2 (n - 1) / n`` for an all-reduce, a figure that can be compared with the link's peak whatever
``n`` is. Everything here is a MODEL (arithmetic on figures you pass), never a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from accel import checks

__all__ = ["ALGORITHMS", "MEDIA", "terms", "allreduce_time", "crossover_bytes",
           "algorithm_bandwidth",
           "bus_bandwidth", "BUS_FACTORS", "ring_all_reduce_bytes", "sharded_ps_time",
           "packed_time", "local_sgd_step_time", "overlapped_step_time"]

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


def ring_all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``nbytes``: ``2 (n - 1) / n * nbytes``
    (``BUS_FACTORS["all_reduce"]``)."""
    n = checks.positive_int("n", n)
    return BUS_FACTORS["all_reduce"](n) * checks.non_negative_number("nbytes", nbytes)

def _check_n(n: int) -> int:
    return checks.positive_int("n", n)


def terms(algorithm: str, n: int, medium: str = "links") -> tuple[float, float]:
    """``(latency terms, factor)``: the all-reduce of ``S`` bytes on ``n`` devices costs
    ``terms[0] * alpha + terms[1] * S / bandwidth``.

    ``medium="links"`` (the table above): every device has its own link and the links run in
    parallel, so the messages in a row (steps) and the busiest link set the time.
    ``medium="shared"``: one medium carries every message and every byte in turn (processes on
    one machine's loopback, sharing its cores and memory), so both terms are totals over all
    devices: messages ``2 n (n - 1)`` for the ``ring`` (n in each of its 2 (n - 1) steps),
    ``2 (n - 1)`` for ``one_device`` and ``tree``, ``n (n - 1)`` for ``direct``; bytes
    ``2 (n - 1) S`` for the first three alike, ``n (n - 1) S`` for ``direct``."""
    checks.one_of("algorithm", algorithm, ALGORITHMS)
    checks.one_of("medium", medium, MEDIA)
    n = _check_n(n)
    if n == 1:
        return 0.0, 0.0
    if medium == "shared":
        messages = {"ring": 2 * n * (n - 1), "direct": n * (n - 1)}.get(algorithm, 2 * (n - 1))
        return float(messages), float(n * (n - 1) if algorithm == "direct" else 2 * (n - 1))
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


def sharded_ps_time(nbytes: float, workers: int, servers: int, latency_s: float,
                    bandwidth_bps: float) -> float:
    """One synchronous exchange with parameter servers on their own machines (chapter 12's
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
