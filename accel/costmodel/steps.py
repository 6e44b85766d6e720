"""Times from figures: the work of a training run, a copy over a link, a data-parallel step.

Every function is a MODEL (arithmetic on peak figures from ``accel.costmodel.hardware`` or on
numbers you pass), never a measurement.
"""

from __future__ import annotations

from accel import checks
from accel.costmodel.collectives import BUS_FACTORS
from accel.costmodel.hardware import link_bandwidth

__all__ = ["training_flops", "days_to_train", "transfer_time", "SCHEMES",
           "data_parallel_step_time"]

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
