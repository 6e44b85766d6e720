"""ZeRO's memory and communication per device: the formulas of Rajbhandari et al. 2019, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054 (section 5,
figure 1), for a model of ``params`` (Ψ) parameters trained with Adam on ``n`` data-parallel
devices. Pure Python over plain numbers.

Bytes per parameter, by what a device keeps for the training step:

* ``"mixed"`` (the paper's case): fp16 weights 2, fp16 gradients 2, and Adam's optimizer state
  12 (an fp32 master copy of the weights, fp32 first and second moments), 16 in all;
* ``"fp32"`` (what runs in this course): fp32 weights 4, fp32 gradients 4, Adam's two fp32
  moments 8 (the weights themselves are the master copy), 16 in all;
* ``"megatron_bf16"``: Megatron Core's count for 16-bit parameters with fp32 gradients, what
  its bf16 training keeps (``megatron/training/arguments.py``, ``validate_args``: bf16
  accumulates and all-reduces the gradients in fp32 unless ``--grad-reduce-in-bf16``): bf16
  weights 2, fp32 gradients 4, optimizer state 12 (fp32 master weights, m, v), 18 in all;
* ``"megatron_fp16"``: Megatron Core's count for 16-bit parameters and gradients: weights 2,
  gradients 2, optimizer state 16 (an fp32 copy of the gradients, the "main grads", besides
  the fp32 master weights, m and v), 20 in all.

Megatron Core's distributed-optimizer guide (docs.nvidia.com/megatron-core, "Distributed
Optimizer") tabulates 20, 18 and 16 bytes per parameter without sharding and ``4 + 16/d``,
``6 + 12/d``, ``8 + 8/d`` with its distributed optimizer, which shards the optimizer state
only: stage 1 here (``MEGATRON_DISTRIBUTED_OPTIMIZER``).

Stage 0 is plain data parallelism (every device holds everything); stage 1 shards the optimizer
state over the ``n`` devices, stage 2 also the gradients, stage 3 also the weights:

=======  ===================  ====================
stage    mixed precision      float32
=======  ===================  ====================
0        16Ψ                  16Ψ
1        4Ψ + 12Ψ/N           8Ψ + 8Ψ/N
2        2Ψ + 14Ψ/N           4Ψ + 12Ψ/N
3        16Ψ/N                16Ψ/N
=======  ===================  ====================

Communication (paper, section 7): stages 0-2 send what data parallelism's all-reduce sends,
a reduce-scatter of the gradients then an all-gather of the weights, ``2 (N-1)/N`` times the
gradient bytes per device; stage 3 gathers the weights twice (forward and backward) and
reduce-scatters the gradients, ``3 (N-1)/N``: 1.5 times as much.
"""

from __future__ import annotations

import math

from accel import checks
from accel.costmodel.collectives import BUS_FACTORS
from accel.costmodel.hardware import link_bandwidth, peak_flops

__all__ = ["STAGES", "PRECISIONS", "ZERO_SOURCE", "BYTES_PER_PARAM", "ADAM_MIXED_BYTES_PER_PARAM",
           "shard_elements",
           "zero_bytes_per_device", "zero_total_bytes", "zero_comm_bytes",
           "zero_comm_bytes_accumulated", "ZERO_PIPELINE_SOURCE", "zero_formula",
           "OFFLOAD_SOURCE", "offload_step", "offload_break_even_tokens",
           "MEGATRON_DISTRIBUTED_OPTIMIZER", "HOST_ADAM_BYTES_PER_PARAM", "zero_offload_step",
           "host_adam_break_even_tokens", "zero3_gather_hidden_tokens"]

ZERO_SOURCE = ("Rajbhandari, Rasley, Ruwase, He, 'ZeRO: Memory Optimizations Toward Training "
               "Trillion Parameter Models', arXiv:1910.02054 (2019), sections 5 and 7")
STAGES = (0, 1, 2, 3)
PRECISIONS = ("mixed", "fp32", "megatron_bf16", "megatron_fp16")
# precision -> bytes per parameter of (weights, gradients, optimizer state) with Adam
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "mixed": {"weights": 2, "grads": 2, "optimizer": 12},
    "fp32": {"weights": 4, "grads": 4, "optimizer": 8},
    "megatron_bf16": {"weights": 2, "grads": 4, "optimizer": 12},
    "megatron_fp16": {"weights": 2, "grads": 2, "optimizer": 16},
}
# Megatron Core's table (distributed-optimizer guide): precision -> (bytes per parameter
# without sharding, with the distributed optimizer as written there, d = data-parallel size)
MEGATRON_DISTRIBUTED_OPTIMIZER = {"megatron_fp16": (20, "4 + 16/d"),
                                  "megatron_bf16": (18, "6 + 12/d"),
                                  "fp32": (16, "8 + 8/d")}
# 16: the bytes per parameter of mixed-precision Adam without sharding (section 3.1: 2 + 2 + 12)
ADAM_MIXED_BYTES_PER_PARAM = sum(BYTES_PER_PARAM["mixed"].values())
OFFLOAD_SOURCE = ("Ren et al., 'ZeRO-Offload: Democratizing Billion-Scale Model Training', "
                  "USENIX ATC 2021, arXiv:2101.06840: section 3.3, fp16 gradients to the CPU "
                  "and fp16 parameters back (2M bytes each way for M parameters); section 4.2, "
                  "on N GPUs built on ZeRO-2, each GPU offloads only its gradient partition "
                  "and each data-parallel process updates its partition on the CPU; section "
                  "5.2, the delayed parameter update")
# what DeepSpeed does with ZeRO 2-3 and several micro-batches per step, and with a pipeline
ZERO_PIPELINE_SOURCE = (
    "DeepSpeed: a rank keeps only its shard of the gradients, so ZeRO 2 and 3 reduce-scatter "
    "after every backward, accumulation boundary or not (deepspeedai/DeepSpeed issue #2252, "
    "answer by T. Ruwase); its pipeline engine refuses them: deepspeed/runtime/pipe/engine.py, "
    "PipelineEngine.__init__, assert zero_optimization_stage() < ZeroStageEnum.gradients, "
    "'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism'")
_SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"),
            3: ("optimizer", "grads", "weights")}


def _check(params, n, stage, precision) -> tuple[int, int]:
    params = checks.positive_int("params", params)
    n = checks.positive_int("n", n)
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"stage must be one of {list(STAGES)} (0 = plain data parallelism), "
                         f"got {stage!r}")
    checks.one_of("precision", precision, PRECISIONS)
    return params, n


def shard_elements(params: int, n: int) -> int:
    """Elements of one device's shard when ``params`` are flattened and padded to a multiple of
    ``n``: ``ceil(params / n)``."""
    return math.ceil(checks.positive_int("params", params) / checks.positive_int("n", n))


def zero_bytes_per_device(params: int, n: int, stage: int, precision: str = "mixed",
                          pad: bool = False) -> dict[str, float]:
    """Bytes one device holds for ``weights``, ``grads`` and ``optimizer`` state (Adam) at ZeRO
    ``stage`` (0-3) on ``n`` devices, plus their ``total``. A sharded part counts ``params / n``
    elements (the paper's formula), or ``ceil(params / n)`` with ``pad=True`` (what an
    implementation that pads the flat parameter vector to a multiple of ``n`` holds)."""
    params, n = _check(params, n, stage, precision)
    shard = shard_elements(params, n) if pad else params / n
    out = {}
    for part, per_param in BYTES_PER_PARAM[precision].items():
        out[part] = per_param * (shard if part in _SHARDED[stage] else params)
    out["total"] = out["weights"] + out["grads"] + out["optimizer"]
    return out


def zero_total_bytes(params: int, n: int, stage: int, precision: str = "mixed") -> float:
    """``zero_bytes_per_device(...)["total"]``: bytes per device for the model states."""
    return zero_bytes_per_device(params, n, stage, precision)["total"]


def zero_comm_bytes(params: int, n: int, stage: int, precision: str = "mixed") -> float:
    """Bytes one device sends per training step: ``2 (n-1)/n`` times the gradient bytes for
    stages 0-2 (reduce-scatter + all-gather, the volume of a ring all-reduce), ``3 (n-1)/n`` for
    stage 3 (the weights gathered for the forward and again for the backward pass, the gradients
    reduce-scattered). Gradients move at the gradients' precision, gathered weights at the
    weights' (stage 0 all-reduces the gradients: both halves at the gradients')."""
    params, n = _check(params, n, stage, precision)
    grads = params * BYTES_PER_PARAM[precision]["grads"]
    weights = grads if stage == 0 else params * BYTES_PER_PARAM[precision]["weights"]
    gathers = 2 if stage == 3 else 1
    return (BUS_FACTORS["reduce_scatter"](n) * grads
            + gathers * BUS_FACTORS["all_gather"](n) * weights)


def zero_comm_bytes_accumulated(params: int, n: int, stage: int, microbatches: int = 1,
                                precision: str = "mixed") -> float:
    """Bytes one device sends per step of ``microbatches`` micro-batches (gradient
    accumulation). Stages 0-1 keep the whole gradient and accumulate it locally: one all-reduce
    per step, ``2 (n-1)/n`` gradient bytes, whatever ``microbatches``. Stage 2 keeps only its
    gradient shard, so it reduce-scatters after every micro-batch's backward, then all-gathers
    the updated weights once: ``(m + 1) (n-1)/n``. Stage 3 also gathers the weights for every
    micro-batch's forward and backward: ``3 m (n-1)/n`` (``ZERO_PIPELINE_SOURCE``). With
    ``microbatches=1`` this is ``zero_comm_bytes``."""
    params, n = _check(params, n, stage, precision)
    m = checks.positive_int("microbatches", microbatches)
    if stage < 2:
        return zero_comm_bytes(params, n, stage, precision)
    grads = params * BYTES_PER_PARAM[precision]["grads"]
    weights = params * BYTES_PER_PARAM[precision]["weights"]
    scatter, gather = BUS_FACTORS["reduce_scatter"](n), BUS_FACTORS["all_gather"](n)
    if stage == 2:
        return m * scatter * grads + gather * weights
    return m * (scatter * grads + 2 * gather * weights)


def zero_formula(stage: int, precision: str = "mixed") -> str:
    """The per-device total as the paper writes it, e.g. ``'4Ψ + 12Ψ/N'``."""
    _check(1, 1, stage, precision)
    per = BYTES_PER_PARAM[precision]
    whole = sum(v for k, v in per.items() if k not in _SHARDED[stage])
    split = sum(v for k, v in per.items() if k in _SHARDED[stage])
    terms = ([f"{whole}Ψ"] if whole else []) + ([f"{split}Ψ/N"] if split else [])
    return " + ".join(terms)


# ZeRO-Offload's host Adam pass streams each parameter's state through DRAM once per step: the
# 16-bit gradient read (2 bytes), the fp32 master weight, m and v each read and written (24),
# the 16-bit weight written for the copy back (2): 28 bytes per parameter. Adam's arithmetic
# (about 10 FLOPs per parameter) is far below what the cores do in that time: memory-bound.
HOST_ADAM_BYTES_PER_PARAM = 28


def _utilization(utilization: float) -> float:
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return utilization


def _link(link) -> float:
    """``link``'s one-direction bandwidth in bytes per second: a name from
    ``accel.costmodel.hardware.LINKS`` or a positive number of bytes per second (a link that
    table does not hold, e.g. a GH200's NVLink-C2C)."""
    if isinstance(link, str):
        return link_bandwidth(link)
    return checks.positive_number("link", link)


def offload_step(params: int, tokens: int, device: str, link, precision: str = "fp16",
                 utilization: float = 0.5, bytes_per_param: int = 2, n: int = 1,
                 link_share: int = 1) -> dict:
    """MODEL of one step with the optimizer offloaded over ``link``, on each of ``n``
    data-parallel GPUs: ``compute_s``, the GPU's forward + backward, ``6 params tokens`` FLOPs
    (``tokens`` per GPU) at ``utilization`` of ``device``'s peak; ``transfer_s``, the GPU's
    gradient partition down and its parameter partition up, ``bytes_per_param params / n``
    each way at once (ZeRO-Offload partitions before it offloads, section 4.2; a PCIe link is
    full duplex), over a host link that ``link_share`` GPUs share (a DGX A100 puts two GPUs
    behind each PCIe switch's uplink: ``link_share=2`` doubles the time); ``step_s`` = the
    larger when the two overlap, and ``bottleneck``: ``"compute"`` (the link is free) or
    ``"transfer"``. The host's Adam is left out: ``zero_offload_step`` adds it. ``link``: a
    name of ``accel.costmodel.hardware.LINKS`` or bytes per second."""
    params = checks.positive_int("params", params)
    tokens = checks.positive_int("tokens", tokens)
    n = checks.positive_int("n", n)
    share = checks.positive_int("link_share", link_share)
    compute = 6 * params * tokens / (peak_flops(device, precision) * _utilization(utilization))
    transfer = params / n * checks.positive_int("bytes_per_param", bytes_per_param) * share / \
        _link(link)
    return {"compute_s": compute, "transfer_s": transfer, "step_s": max(compute, transfer),
            "bottleneck": "compute" if compute >= transfer else "transfer"}


def offload_break_even_tokens(device: str, link, precision: str = "fp16",
                              utilization: float = 0.5, bytes_per_param: int = 2,
                              n: int = 1, link_share: int = 1) -> float:
    """Tokens per GPU and step above which the offload traffic hides under the compute:
    ``6 params tokens / R = bytes_per_param params s / (n B)`` (``s = link_share``) gives
    ``tokens = bytes_per_param R s / (6 n B)``, whatever the model's size."""
    rate = peak_flops(device, precision) * _utilization(utilization)
    return checks.positive_int("bytes_per_param", bytes_per_param) * rate * \
        checks.positive_int("link_share", link_share) / \
        (6 * checks.positive_int("n", n) * _link(link))


def zero_offload_step(params: int, tokens: int, device: str, link, host_bandwidth: float,
                      n: int = 1, precision: str = "bf16", utilization: float = 0.5,
                      link_share: int = 1) -> dict:
    """MODEL of a ZeRO-Offload step on each of ``n`` data-parallel GPUs: ``offload_step``'s
    ``compute_s`` and ``transfer_s`` plus ``adam_s``, the host's Adam pass over THIS process's
    partition, ``HOST_ADAM_BYTES_PER_PARAM params / n`` bytes at ``host_bandwidth`` (the DRAM
    bandwidth this process gets: the processes of a node share its sockets). Two step times:
    ``serial_s``, Adam after the backward (the GPU waits for it: a lower bound, the copy back
    after Adam waits too), and ``dpu_s``, ZeRO-Offload's delayed parameter update (section
    5.2: step t's Adam runs while the GPU computes step t+1 from weights one step old), the
    largest of the three; ``bottleneck`` names that largest (``"compute"``, ``"link"``,
    ``"host adam"``). Left out, so every time is a lower bound: the GPUs' own reduce-scatter
    and all-gather among themselves (ZeRO 2), the copy of the 16-bit weights back after Adam
    on the serial path, and Adam below the DRAM's peak (``host_bandwidth`` is a peak)."""
    e = offload_step(params, tokens, device, link, precision, utilization, 2, n, link_share)
    host_bandwidth = checks.positive_number("host_bandwidth", host_bandwidth)
    adam = HOST_ADAM_BYTES_PER_PARAM * params / n / host_bandwidth
    times = {"compute": e["compute_s"], "link": e["transfer_s"], "host adam": adam}
    return {"compute_s": e["compute_s"], "transfer_s": e["transfer_s"], "adam_s": adam,
            "serial_s": max(e["compute_s"], e["transfer_s"]) + adam,
            "dpu_s": max(times.values()), "bottleneck": max(times, key=times.get)}


def host_adam_break_even_tokens(device: str, host_bandwidth: float, n: int = 1,
                                precision: str = "bf16", utilization: float = 0.5) -> float:
    """Tokens per GPU and step from which the host's Adam over this process's partition hides
    under the compute (with the delayed update): ``6 params tokens / R = 28 params / (n
    B_host)``, so ``tokens = 28 R / (6 n B_host)``, whatever the model's size."""
    rate = peak_flops(device, precision) * _utilization(utilization)
    return HOST_ADAM_BYTES_PER_PARAM * rate / (
        6 * checks.positive_int("n", n) * checks.positive_number("host_bandwidth",
                                                                  host_bandwidth))


def zero3_gather_hidden_tokens(device: str, link, n: int, precision: str = "bf16",
                               utilization: float = 0.5, bytes_per_param: int = 2) -> float:
    """MODEL: tokens per GPU and micro-batch from which ZeRO stage 3's all-gather of one layer
    hides under the previous layer's compute, when prefetch runs it beside that compute. A
    layer of ``L`` parameters: its all-gather receives ``(n-1)/n bytes_per_param L`` bytes
    over ``link`` (each GPU's one-direction bandwidth), its forward takes ``2 L tokens`` FLOPs
    at ``utilization`` of ``device``'s peak; equal when ``tokens = (n-1)/n bytes_per_param R /
    (2 B)``, whatever ``L`` (equal layers assumed). The backward has twice the FLOPs and twice
    the bytes (the gather and the gradients' reduce-scatter): the same point. ``link``: a name
    of ``accel.costmodel.hardware.LINKS`` or bytes per second."""
    n = checks.positive_int("n", n)
    if n < 2:
        raise ValueError(f"n must be at least 2 (nothing to gather on one device), got {n}")
    rate = peak_flops(device, precision) * _utilization(utilization)
    return (n - 1) / n * checks.positive_int("bytes_per_param", bytes_per_param) * rate / \
        (2 * _link(link))
