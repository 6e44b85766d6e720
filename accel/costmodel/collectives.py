"""The alpha-beta (latency-bandwidth) model of an all-reduce, and what follows from it.

Every message costs ``alpha`` seconds of latency plus its bytes over the link's bandwidth
(``beta = 1 / bandwidth`` seconds per byte). Each device has a link of its own that sends and
receives at the same time (full duplex) but carries one message at a time in each direction
(the "one-port" model of Thakur, Rabenseifner and Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005; the same forms are in MPICH's
``allreduce.c``/``reduce.c`` comments). An all-reduce of ``S`` bytes on ``n`` devices then takes
``steps * alpha + factor * S / bw``, where ``steps`` counts the messages on the critical path
(those that must follow one another) and ``factor * S`` the bytes those messages carry. Both
terms come from the same messages, so they agree with each other (``terms``):

====================  ==============================  =====================================
algorithm             steps (latency terms)           factor (bytes on the path, / S)
====================  ==============================  =====================================
``one_device``        ``2 (n - 1)``                   ``2 (n - 1)``: the root receives n-1
                                                      tensors one after another, then sends
                                                      n-1
``direct``            ``n - 1``                       ``n - 1``: each device sends n-1
                                                      tensors while it receives n-1
``ring``              ``2 (n - 1)``                   ``2 (n - 1) / n``: 2(n-1) chunks of S/n
``tree`` (binary,     the critical path of whole      the same count (whole tensors): a
whole tensors)        tensors (``tree_path``)         parent takes its two children in turn
``binomial``          ``2 ceil(log2 n)``              ``2 ceil(log2 n)``: binomial reduce +
                                                      binomial broadcast, one message per
                                                      device per round
``halving_doubling``  ``2 log2 n``                    ``2 (n - 1) / n``: Rabenseifner's
                                                      recursive-halving reduce-scatter +
                                                      recursive-doubling all-gather
====================  ==============================  =====================================

For ``n`` not a power of two, ``halving_doubling`` folds the ``r = n - p`` extra devices
(``p`` the largest power of two below ``n``) onto partners first and unfolds at the end:
``2 log2 p + 2`` steps and factor ``2 (p - 1) / p + 2`` (MPICH's non-power-of-two form).

Few steps win for small messages (latency), a small factor for big ones (bandwidth);
``crossover_bytes`` is the size where two algorithms cost the same. The ring's factor
``2 (n - 1) / n`` is the least any all-reduce can have (every device must send, and receive,
``(n - 1) / n`` of the data twice: once reducing, once gathering; nccl-tests'
``doc/PERFORMANCE.md`` derives the same bound): the ring is *bandwidth-optimal*, not optimal.
Halving-doubling has the same factor with ``2 log2 n`` steps instead of ``2 (n - 1)``, so in this
model it is never slower than the ring (for a power-of-two ``n``).

``medium="shared"`` is the other picture: no link per device, one machine that carries every
message and every byte in turn (processes on one machine's loopback). The bandwidths the course
quotes are NVIDIA's nccl-tests definitions: *algorithm bandwidth* = ``S / time``; *bus
bandwidth* = algorithm bandwidth times ``BUS_FACTORS[collective](n)`` (``2 (n - 1) / n`` for an
all-reduce, ``(n - 1) / n`` for reduce-scatter, all-gather and all-to-all), a figure that can be
compared with the link's peak whatever ``n`` is. Everything here is a MODEL (arithmetic on
figures you pass), never a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from accel import checks
from accel.costmodel.hardware import LINKS, Spec

__all__ = ["ALGORITHMS", "MEDIA", "terms", "tree_path", "allreduce_time", "crossover_bytes",
           "all_to_all_time",
           "algorithm_bandwidth",
           "bus_bandwidth", "BUS_FACTORS", "ring_all_reduce_bytes", "sharded_ps_time",
           "packed_time", "local_sgd_step_time", "overlapped_step_time", "TWO_LEVEL",
           "two_level_time", "network_bytes_per_node", "COLLECTIVES", "collective_time",
           "CURRENT_LINKS", "link_spec"]

ALGORITHMS = ("one_device", "direct", "ring", "tree", "binomial", "halving_doubling")
MEDIA = ("links", "shared")

# collective -> bus-bandwidth factor as a function of n (nccl-tests doc/PERFORMANCE.md)
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
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


def tree_path(n: int) -> int:
    """Messages on the critical path of the binary-tree all-reduce (``accel.collectives.tree``:
    device ``i``'s children are ``2i + 1`` and ``2i + 2``) in the one-port model, every message a
    whole tensor: going up, a parent receives its children's partial sums one after another (in
    the order they are ready); going down, it sends the total to its children one after
    another."""
    n = _check_n(n)
    ready = [0] * n
    for i in reversed(range(n)):
        t = 0
        for r in sorted(ready[c] for c in (2 * i + 1, 2 * i + 2) if c < n):
            t = max(t, r) + 1
        ready[i] = t
    got = [0] * n
    got[0] = ready[0]
    for i in range(n):
        for k, c in enumerate(c for c in (2 * i + 1, 2 * i + 2) if c < n):
            got[c] = got[i] + k + 1
    return max(got)


def terms(algorithm: str, n: int, medium: str = "links") -> tuple[float, float]:
    """``(latency terms, factor)``: the all-reduce of ``S`` bytes on ``n`` devices costs
    ``terms[0] * alpha + terms[1] * S / bandwidth``.

    ``medium="links"`` (the table above): every device has its own full-duplex link, one
    message at a time each way; both terms count the messages on the critical path.
    ``medium="shared"``: one medium carries every message and every byte in turn (processes on
    one machine's loopback, sharing its cores and memory), so both terms are totals over all
    devices: messages ``2 n (n - 1)`` for the ``ring`` (n in each of its 2 (n - 1) steps),
    ``2 p log2 p + 2 r`` for ``halving_doubling``, ``n (n - 1)`` for ``direct``, ``2 (n - 1)``
    for the others; bytes ``n (n - 1) S`` for ``direct``, ``2 (n - 1) S`` for all the others."""
    checks.one_of("algorithm", algorithm, ALGORITHMS)
    checks.one_of("medium", medium, MEDIA)
    n = _check_n(n)
    if n == 1:
        return 0.0, 0.0
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    log_p = p.bit_length() - 1
    if medium == "shared":
        messages = {"ring": 2 * n * (n - 1), "direct": n * (n - 1),
                    "halving_doubling": 2 * p * log_p + 2 * (n - p)}.get(algorithm, 2 * (n - 1))
        return float(messages), float(n * (n - 1) if algorithm == "direct" else 2 * (n - 1))
    if algorithm == "one_device":
        return 2.0 * (n - 1), 2.0 * (n - 1)
    if algorithm == "direct":
        return float(n - 1), float(n - 1)
    if algorithm == "ring":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if algorithm == "tree":
        path = float(tree_path(n))
        return path, path
    if algorithm == "binomial":
        rounds = (n - 1).bit_length()  # ceil(log2 n)
        return 2.0 * rounds, 2.0 * rounds
    fold = 0 if p == n else 2  # halving_doubling: fold the extra devices in, and out again
    return 2.0 * log_p + fold, 2.0 * (p - 1) / p + fold


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
                    bandwidth_bps: float, pipelined: bool = False) -> float:
    """One synchronous exchange with parameter servers on their own machines (chapter 12's
    placement): every worker sends its ``nbytes`` of gradients and fetches ``nbytes`` of
    weights; the variables are sharded evenly over ``servers`` tasks, so each server's link
    carries ``workers * nbytes / servers`` each way, each worker's link ``nbytes``.

    ``pipelined=False``: a server sends a shard's new weights only once every worker's gradient
    of that shard has arrived, and the shard moves as one message, so each link's receive and
    send follow one another: ``2 (alpha + busiest / bw)`` with ``busiest = max(nbytes, workers *
    nbytes / servers)``. ``pipelined=True``: the shards are cut into many small pieces and each
    piece's weights go back while the next piece's gradients arrive, so a full-duplex link
    receives and sends at once: ``2 alpha + busiest / bw`` (the pieces' own latencies left out:
    the limit of fine pipelining)."""
    checks.non_negative_number("nbytes", nbytes)
    checks.positive_int("workers", workers)
    checks.positive_int("servers", servers)
    checks.non_negative_number("latency_s", latency_s)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    busiest = max(nbytes, workers * nbytes / servers)
    if pipelined:
        return 2 * latency_s + busiest / bandwidth_bps
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


TWO_LEVEL = ("flat_ring", "hierarchical", "hierarchical_pipelined")


def two_level_time(nbytes: float, nodes: int, per_node: int, intra_latency_s: float,
                   intra_bandwidth_bps: float, inter_latency_s: float,
                   inter_bandwidth_bps: float, scheme: str = "hierarchical") -> float:
    """Modelled all-reduce of ``nbytes`` per GPU over ``nodes`` nodes of ``per_node`` GPUs:
    inside a node every GPU has a link of ``intra_bandwidth_bps`` (NVLink through NVSwitch),
    and every GPU has a network adapter of its own, ``inter_bandwidth_bps`` (a rail per GPU,
    as in NVIDIA's DGX H100); latencies per message ``intra_latency_s`` and ``inter_latency_s``.

    ``"flat_ring"``: one ring over all ``P = nodes * per_node`` GPUs, run as ``per_node`` rings
    side by side on ``1 / per_node`` of the data each, one per adapter, so that every adapter
    is busy (NCCL's rings are flat and use all adapters: NVIDIA/nccl#530). Each of its
    ``2 (P - 1)`` steps waits for its slowest hop, a network one:
    ``2 (P - 1) inter_latency + 2 (P - 1) / P * nbytes / min(intra_bw, per_node * inter_bw)``.
    A node's adapters together send ``2 (P - 1) / P * nbytes`` (``network_bytes_per_node``).

    ``"hierarchical"`` (2-D): reduce-scatter inside each node (ring over ``per_node``), then
    ``per_node`` all-reduces between nodes side by side, each of ``1 / per_node`` of the data
    over its own adapter (ring over ``nodes``), then all-gather inside the node:
    ``2 (g - 1) intra_latency + 2 (g - 1) / g * nbytes / intra_bw
    + 2 (N - 1) inter_latency + 2 (N - 1) / N * nbytes / (g * inter_bw)``
    with ``g = per_node``, ``N = nodes``; the three phases follow one another. A node's
    adapters together send ``2 (N - 1) / N * nbytes``: half the flat ring's at two nodes.

    ``"hierarchical_pipelined"``: the same messages, cut into many chunks that flow through the
    three phases at once (as NCCL's Tree pipelines its chunks: NVIDIA/nccl#545): the latencies
    still add up, but the bandwidth term is the slower of the two links' loads, each GPU's
    NVLink carrying its reduce-scatter and all-gather (``2 (g - 1) / g * nbytes``) and its
    adapter its share between nodes (the limit of fine chunks).

    One node (``nodes=1``) is a ring inside the node for every scheme. A MODEL: protocols and
    the adapters' placement on PCIe are left out."""
    checks.non_negative_number("nbytes", nbytes)
    nodes = checks.positive_int("nodes", nodes)
    g = checks.positive_int("per_node", per_node)
    checks.non_negative_number("intra_latency_s", intra_latency_s)
    checks.positive_number("intra_bandwidth_bps", intra_bandwidth_bps)
    checks.non_negative_number("inter_latency_s", inter_latency_s)
    checks.positive_number("inter_bandwidth_bps", inter_bandwidth_bps)
    checks.one_of("scheme", scheme, TWO_LEVEL)
    inside = allreduce_time(nbytes, g, "ring", intra_latency_s, intra_bandwidth_bps)
    if nodes == 1:
        return inside
    if scheme == "flat_ring":
        p = nodes * g
        return allreduce_time(nbytes, p, "ring", inter_latency_s,
                              min(intra_bandwidth_bps, g * inter_bandwidth_bps))
    between = allreduce_time(nbytes / g, nodes, "ring", inter_latency_s, inter_bandwidth_bps)
    if scheme == "hierarchical":
        return inside + between
    (s_in, f_in), (s_out, f_out) = terms("ring", g), terms("ring", nodes)
    return (s_in * intra_latency_s + s_out * inter_latency_s
            + max(f_in * nbytes / intra_bandwidth_bps,
                  f_out * nbytes / g / inter_bandwidth_bps))


def network_bytes_per_node(nbytes: float, nodes: int, per_node: int,
                           scheme: str = "hierarchical") -> float:
    """Bytes a node's network adapters send, together, in ``two_level_time``'s all-reduce of
    ``nbytes`` per GPU: ``2 (P - 1) / P * nbytes`` for the flat ring (``P = nodes * per_node``,
    the ring's bytes per GPU, ``per_node`` rings each crossing out of the node once per step),
    ``2 (N - 1) / N * nbytes`` for both 2-D schemes (each GPU's ``1 / per_node`` share, all-reduced
    by a ring over the ``N`` nodes)."""
    checks.non_negative_number("nbytes", nbytes)
    nodes = checks.positive_int("nodes", nodes)
    g = checks.positive_int("per_node", per_node)
    checks.one_of("scheme", scheme, TWO_LEVEL)
    if scheme == "flat_ring":
        return ring_all_reduce_bytes(nbytes, nodes * g) if nodes > 1 else 0.0
    return ring_all_reduce_bytes(nbytes, nodes)


# collective -> (latency terms, factor of S) on n devices, one-port links, S the whole array:
# a ring (n - 1 steps of S / n) for all-gather and reduce-scatter, the direct pairwise exchange
# (n - 1 rounds, one partner each, S / n to each) for all-to-all: every device sends (n - 1) / n S
COLLECTIVES = {
    "all_reduce": lambda n: terms("ring", n),
    "all_gather": lambda n: (float(n - 1), (n - 1) / n),
    "reduce_scatter": lambda n: (float(n - 1), (n - 1) / n),
    "all_to_all": lambda n: (float(n - 1), (n - 1) / n),
}


def collective_time(collective: str, nbytes: float, n: int, latency_s: float,
                    bandwidth_bps: float) -> float:
    """Modelled seconds of one ``collective`` (a key of ``COLLECTIVES``) over ``n`` devices, of
    ``nbytes`` = nccl-tests' ``S``: the whole gathered, reduced-and-scattered or exchanged
    array (for ``all_reduce``, one device's tensor): ``steps * alpha + factor * S / bw``. The
    factor is ``BUS_FACTORS[collective](n)``: what each device must send, over ``S``."""
    checks.one_of("collective", collective, COLLECTIVES)
    checks.non_negative_number("nbytes", nbytes)
    checks.non_negative_number("latency_s", latency_s)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    n = _check_n(n)
    if n == 1:
        return 0.0
    steps, factor = COLLECTIVES[collective](n)
    return steps * latency_s + factor * nbytes / bandwidth_bps


def all_to_all_time(nbytes: float, n: int, latency_s: float, bandwidth_bps: float) -> float:
    """Modelled seconds of one all-to-all in which each of ``n`` devices sends ``nbytes`` in all
    to the others: chapter 13's one-port alpha-beta model with direct sends (``n - 1`` messages
    one after another on each device's link), so
    ``(n - 1) * latency + nbytes / bandwidth``. For an even all-to-all of ``S``-byte tensors
    ``nbytes`` is ``(n - 1) / n * S`` (``BUS_FACTORS["all_to_all"]``) and this equals
    ``collective_time("all_to_all", S, ...)``; a mixture-of-experts dispatch sends what its
    router chose, so it is given the bytes sent rather than ``S``."""
    n = checks.positive_int("n", n)
    nbytes = checks.non_negative_number("nbytes", nbytes)
    latency_s = checks.non_negative_number("latency_s", latency_s)
    bandwidth_bps = checks.positive_number("bandwidth_bps", bandwidth_bps)
    return (n - 1) * latency_s + nbytes / bandwidth_bps


# Links of 2024-2026 systems that accel.costmodel.hardware.LINKS does not list (one direction,
# GB/s), with their documents
CURRENT_LINKS: dict[str, Spec] = {
    "NVLink 5 (B200, per GPU)": Spec(
        900.0, "NVIDIA HGX B200 specifications: fifth-generation NVLink, 1.8 TB/s per GPU, "
               "both directions"),
    "Infinity Fabric (MI300X, per GPU)": Spec(
        448.0, "AMD Instinct MI300X data sheet: 7 Infinity Fabric links of 128 GB/s (both "
               "directions), one to each other GPU of an 8-GPU platform; all 7 busy at once"),
    "800 Gb/s network (XDR / ConnectX-8)": Spec(
        100.0, "InfiniBand Trade Association roadmap: XDR 800 Gb/s; NVIDIA ConnectX-8 "
               "SuperNIC: 800 Gb/s"),
}


def link_spec(link: str) -> Spec:
    """The ``Spec`` (one-direction GB/s and its source) of ``link``, a key of
    ``accel.costmodel.hardware.LINKS`` or of ``CURRENT_LINKS``."""
    if link in CURRENT_LINKS:
        return CURRENT_LINKS[link]
    checks.one_of("link", link, [*LINKS, *CURRENT_LINKS])
    return LINKS[link]
