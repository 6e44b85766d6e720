"""Chapter 02's experiment: what crossing a device boundary costs, measured on this machine.

Two effects, measured separately:

* per-edge overhead: a chain of small ops that hops between devices at every step pays a
  ``_Send``/``_Recv`` pair per hop, even when no byte has to move;
* bytes moved: a large tensor consumed on another device. Logical CPUs of one process share host
  memory, so TensorFlow hands the buffer over without copying; between a CPU and a GPU (or two
  GPUs) the bytes really travel over PCIe / NVLink, which ``accel.costmodel.steps.transfer_time``
  models.

On a GPU a copy also has a fixed cost, whatever its size: ``copy_time`` and
``break_even_bytes`` model one copy as that latency plus its bytes over a rate, with the
published per-copy latency ``GPU_COPY_LATENCY_S`` (the course's hardware record holds no
small-copy figure).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accel.timing import format_ratios, time_fn

__all__ = ["bench", "chain_function", "consume_function", "measure_hop_cost",
           "measure_copy_cost", "GPU_COPY_LATENCY_S", "GPU_COPY_LATENCY_SOURCE", "copy_time",
           "break_even_bytes"]

# The fixed cost of one copy on an NVIDIA GPU: submitting one cudaMemcpyAsync takes about
# 5-7 microseconds whatever the size (a published figure, not measured by the course).
GPU_COPY_LATENCY_S = (5e-6, 7e-6)
GPU_COPY_LATENCY_SOURCE = ("Wu et al., \"DualPath: Breaking the Storage Bandwidth Bottleneck in "
                           "Agentic LLM Inference\", arXiv:2602.21548, 2026, section 5.2: about "
                           "5-7 us per cudaMemcpyAsync call for small copies")


def copy_time(nbytes: float, bytes_per_s: float, latency_s: float) -> float:
    """Seconds for one copy of ``nbytes`` (a cost model): a fixed ``latency_s`` plus the bytes at
    ``bytes_per_s``."""
    if nbytes < 0 or latency_s < 0:
        raise ValueError(f"nbytes and latency_s must be >= 0, got {nbytes=}, {latency_s=}")
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
    return latency_s + nbytes / bytes_per_s


def break_even_bytes(latency_s: float, bytes_per_s: float) -> float:
    """The copy size whose bytes take as long as the fixed ``latency_s`` at ``bytes_per_s``:
    smaller copies are mostly fixed cost, larger ones mostly bytes."""
    if not latency_s > 0 or not bytes_per_s > 0:
        raise ValueError(f"latency_s and bytes_per_s must be > 0, got {latency_s=}, "
                         f"{bytes_per_s=}")
    return latency_s * bytes_per_s


def chain_function(devices: Sequence[str], length: int) -> tf.types.experimental.GenericFunction:
    """A ``tf.function`` applying ``length`` small element-wise steps to ``x``; step ``i`` runs on
    ``devices[i % len(devices)]``, so with two devices every step crosses a device boundary."""
    if length < 1 or not devices:
        raise ValueError(f"need length >= 1 and at least one device, got {length=}, {devices=}")

    @tf.function(autograph=False)
    def chain(x):
        for i in range(length):
            with tf.device(devices[i % len(devices)]):
                x = tf.math.sin(x) + 1.0
        return x

    return chain


def consume_function(device: str) -> tf.types.experimental.GenericFunction:
    """A ``tf.function`` that reduces its (large) input on ``device``."""

    @tf.function(autograph=False)
    def consume(x):
        with tf.device(device):
            return tf.reduce_sum(x * 2.0)

    return consume


def measure_hop_cost(devices: Sequence[str] = ("/cpu:0", "/cpu:1"), chain: int = 64,
                     repeat: int = 7, verbose: bool = False) -> dict[str, float]:
    """Time the per-edge effect alone: a chain of ``chain`` small steps on ``devices[0]`` vs the
    same chain hopping between ``devices[0]`` and ``devices[1]`` at every step.

    Both sides get the same warm-up (2 calls) and report the median of ``repeat`` calls on one
    clock. Returns the two median times (s), ``chain_ratio`` (hopping / one device) and the
    chain's costs in microseconds: ``us_per_op`` (the one-device chain's time / its ``chain``
    steps) and ``us_per_hop`` (the hopping chain's extra time / its ``chain - 1`` device
    crossings). Between logical CPUs of one process a crossing moves no byte, so the per-hop
    figure is scheduling (a rendezvous hand-off between executor threads); on two shared cores
    it moves with the machine's load, and is below zero when the hopping run happened to be the
    faster: read it beside the run's ceiling (``accel.timing.ceiling_line``).
    """
    if len(devices) < 2:
        raise ValueError(f"need two devices to compare, got {list(devices)}")
    if chain < 2:
        raise ValueError(f"chain must be >= 2 (one crossing at least), got {chain}")
    small = tf.ones((256,))
    times = {}
    for label, devs in (("chain on one device", devices[:1]), ("chain hopping", devices[:2])):
        fn = chain_function(list(devs), chain)
        times[label] = time_fn(lambda fn=fn: fn(small).numpy(), repeat=repeat, warmup=2)
    per_op = times["chain on one device"] / chain * 1e6
    per_hop = (times["chain hopping"] - times["chain on one device"]) / (chain - 1) * 1e6
    if verbose:
        print(format_ratios(times, "chain on one device"))
        print(f"per step of the chain: {per_op:.1f} us; per device crossing, beyond that: "
              f"{per_hop:.1f} us")
    return {**times, "chain_ratio": times["chain hopping"] / times["chain on one device"],
            "us_per_op": per_op, "us_per_hop": per_hop}


def measure_copy_cost(devices: Sequence[str] = ("/cpu:0", "/cpu:1"), size: int = 2**22,
                      chain: int = 64, repeat: int = 7, verbose: bool = False) -> dict[str, float]:
    """Time the two effects on ``devices[0]`` vs ``devices[0]`` <-> ``devices[1]``.

    Returns the median times (s), the ratios ``chain_ratio`` (hopping / one device) and
    ``bulk_ratio`` (tensor consumed on the other device / on its own device), and the chain's
    costs in microseconds: ``us_per_op`` (the one-device chain's time / its ``chain`` steps)
    and ``us_per_hop`` (the hopping chain's extra time / its ``chain - 1`` device crossings;
    below zero when the hopping run happened to be the faster).
    """
    if len(devices) < 2:
        raise ValueError(f"need two devices to compare, got {list(devices)}")
    small = tf.ones((256,))
    with tf.device(devices[0]):
        big = tf.random.stateless_normal((size,), seed=(1, 2))
    times = {}
    for label, devs in (("chain on one device", devices[:1]), ("chain hopping", devices[:2])):
        fn = chain_function(list(devs), chain)
        times[label] = time_fn(lambda fn=fn: fn(small).numpy(), repeat=repeat, warmup=2)
    for label, dev in (("tensor used in place", devices[0]), ("tensor used elsewhere", devices[1])):
        fn = consume_function(dev)
        times[label] = time_fn(lambda fn=fn: fn(big).numpy(), repeat=repeat, warmup=2)
    per_op = times["chain on one device"] / chain * 1e6
    per_hop = ((times["chain hopping"] - times["chain on one device"]) / max(chain - 1, 1)
               * 1e6)
    if verbose:
        print(format_ratios({k: times[k] for k in list(times)[:2]}, "chain on one device"))
        print(f"per step of the chain: {per_op:.1f} us; per device crossing, beyond that: "
              f"{per_hop:.1f} us")
        print(format_ratios({k: times[k] for k in list(times)[2:]}, "tensor used in place"))
    return {**times,
            "chain_ratio": times["chain hopping"] / times["chain on one device"],
            "bulk_ratio": times["tensor used elsewhere"] / times["tensor used in place"],
            "us_per_op": per_op, "us_per_hop": per_hop}


def bench(device_names: Sequence[str], quick: bool = False) -> dict[str, float]:
    """``python -m accel bench copy-cost``: both effects on the first two devices."""
    if quick:
        return measure_copy_cost(device_names[:2], size=1024, chain=4, repeat=1, verbose=True)
    return measure_copy_cost(device_names[:2], verbose=True)
