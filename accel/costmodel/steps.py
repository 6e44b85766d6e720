"""Times from figures: the work of a training run, a copy over a link, a data-parallel step.

Every function is a MODEL (arithmetic on peak figures from ``accel.costmodel.hardware`` or on
numbers you pass), never a measurement.
"""

from __future__ import annotations

from accel import checks
from accel.costmodel.collectives import BUS_FACTORS
from accel.costmodel.hardware import link_bandwidth

__all__ = ["training_flops", "days_to_train", "transfer_time", "matmul_intensity", "roofline",
           "SCHEMES", "data_parallel_step_time", "overlapped_step_time"]

SCHEMES = ("ring", "one_device", "host")


def training_flops(forward_gflops: float, examples: int, epochs: int) -> float:
    """FLOPs of a training run: forward + backward ~= 3x forward, per example, per epoch
    (chapter 01's Inception-v3 on ImageNet: ``accel.course.training_cost.INCEPTION_V3``)."""
    checks.positive_number("forward_gflops", forward_gflops)
    checks.positive_int("examples", examples)
    checks.positive_int("epochs", epochs)
    return 3.0 * forward_gflops * 1e9 * examples * epochs


def days_to_train(flops: float, tflops: float, utilization: float = 1.0) -> float:
    """Days needed to do ``flops`` of work at ``tflops`` x ``utilization``."""
    checks.positive_number("tflops", tflops)
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return checks.non_negative_number("flops", flops) / (tflops * 1e12 * utilization) / 86400


def transfer_time(nbytes: int, link: str) -> float:
    """Seconds to move ``nbytes`` over ``link`` (a key of ``hardware.LINKS``) at its nominal
    bandwidth: a lower bound."""
    return checks.non_negative_number("nbytes", nbytes) / link_bandwidth(link)


def matmul_intensity(n: int, bytes_per_element: int = 4) -> float:
    """Arithmetic intensity of an ``n`` x ``n`` by ``n`` x ``n`` matmul: its 2 n^3 FLOPs over the
    bytes of its two inputs and its output (3 n^2 elements), each read or written once."""
    checks.positive_int("n", n)
    checks.positive_int("bytes_per_element", bytes_per_element)
    return 2 * n**3 / (3 * n**2 * bytes_per_element)


def roofline(intensity: float, peak_flops: float, bandwidth_bps: float) -> float:
    """The roofline model's attainable FLOP/s (Williams, Waterman & Patterson 2009): the lower
    of the compute peak and ``intensity`` (FLOPs per byte) times the memory bandwidth."""
    checks.positive_number("intensity", intensity)
    checks.positive_number("peak_flops", peak_flops)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    return min(peak_flops, intensity * bandwidth_bps)


def data_parallel_step_time(n: int, compute_s: float, gradient_bytes: float,
                            bandwidth_bps: float, scheme: str = "ring",
                            latency_s: float = 0.0) -> float:
    """Modelled time of one synchronous data-parallel step on ``n`` real accelerators (no
    overlap of communication with compute).

    ``compute_s``: forward + backward of one device's batch. Gradient exchange of
    ``gradient_bytes`` over links of ``bandwidth_bps`` bytes/s:

    * ``"ring"`` (all-reduce, e.g. NCCL): each device sends and receives ``2 (n-1)/n`` times the
      gradients, in ``2 (n-1)`` latency-bound steps;
    * ``"one_device"`` (the towers recipe with the variables on one of the ``n`` accelerators:
      reduce there, then send the new weights back): that device's link carries ``2 (n-1)``
      copies of the gradients' size;
    * ``"host"`` (the classic recipe with the variables on the host CPU): all ``n`` accelerators
      fetch the weights from it and send their gradients to it, ``2 n`` copies over the host's
      link, so even one accelerator pays for the exchange.
    """
    checks.positive_int("n", n)
    checks.non_negative_number("compute_s", compute_s)
    checks.non_negative_number("gradient_bytes", gradient_bytes)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    checks.non_negative_number("latency_s", latency_s)
    checks.one_of("scheme", scheme, SCHEMES)
    copy = gradient_bytes / bandwidth_bps
    if scheme == "ring":
        return compute_s + BUS_FACTORS["all_reduce"](n) * copy + 2 * (n - 1) * latency_s
    if scheme == "one_device":
        return compute_s + 2 * (n - 1) * (copy + latency_s)
    return compute_s + 2 * n * (copy + latency_s)


def overlapped_step_time(n: int, forward_s: float, backward_s: float, gradient_bytes: float,
                         bandwidth_bps: float, bucket_bytes: float | None = None,
                         latency_s: float = 0.0, base_latency_s: float = 0.0) -> dict:
    """Modelled synchronous data-parallel step whose ring all-reduce overlaps the backward pass
    in buckets (PyTorch DDP's ``bucket_cap_mb``; ``accel.parallel.data``'s ``bucket_bytes``).

    The backward pass makes the gradients at an even rate, the last layers' first; the
    gradients are cut into buckets of ``bucket_bytes`` (the last bucket what remains;
    ``None``: one bucket, no overlap, which is ``data_parallel_step_time``'s ring); each bucket
    is all-reduced as soon as the backward has made it and the link is free, one bucket at a
    time, at ``2 (n-1)/n`` times its bytes over ``bandwidth_bps`` plus ``base_latency_s`` and
    ``2 (n-1)`` times ``latency_s`` (its ring's steps: NCCL's own cost model has this form,
    ``baseLat + nsteps * hwLat`` in ``src/graph/tuning.cc``). The exchange is assumed not to
    slow the backward pass (on a GPU its kernels take some of the compute). Returns
    ``step_s`` (forward, backward, and whatever exchange is left when the backward ends),
    ``exposed_s`` (that leftover: what overlap did not hide),
    ``comm_s`` (the exchange's total time) and ``buckets``. Smaller buckets start the exchange
    earlier but pay the latency more often."""
    checks.positive_int("n", n)
    checks.non_negative_number("forward_s", forward_s)
    checks.non_negative_number("backward_s", backward_s)
    checks.non_negative_number("gradient_bytes", gradient_bytes)
    checks.positive_number("bandwidth_bps", bandwidth_bps)
    checks.non_negative_number("latency_s", latency_s)
    checks.non_negative_number("base_latency_s", base_latency_s)
    size = gradient_bytes if bucket_bytes is None else checks.positive_number(
        "bucket_bytes", bucket_bytes)
    sizes, left = [], gradient_bytes
    while left > 0:
        sizes.append(min(size, left))
        left -= sizes[-1]
    sizes = sizes or [0.0]
    made, free, comm = 0.0, forward_s, 0.0
    for nbytes in sizes:
        made += nbytes
        ready = forward_s + backward_s * (made / gradient_bytes if gradient_bytes else 1.0)
        cost = (BUS_FACTORS["all_reduce"](n) * nbytes / bandwidth_bps + base_latency_s
                + 2 * (n - 1) * latency_s)
        free = max(free, ready) + cost
        comm += cost
    end = forward_s + backward_s
    return {"step_s": max(end, free), "exposed_s": max(0.0, free - end), "comm_s": comm,
            "buckets": len(sizes)}
