"""Chapter 01's cost of training: how long one training run of Inception-v3 takes on one device,
this CPU (its matmul throughput measured) against GPUs (vendor peaks, a cost model); and the
model FLOPs utilisation (MFU) large runs publish, recomputed from their published inputs.

The arithmetic is ``accel.costmodel.steps``; the peaks with their sources
``accel.costmodel.hardware``. ``gpu_rows`` is the table the chapter prints; ``PALM_540B``,
``model_flops_per_token`` and ``mfu`` recompute PaLM's published MFU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from accel import checks
from accel.costmodel.hardware import PEAK_TFLOPS
from accel.costmodel.steps import days_to_train, training_flops

__all__ = ["INCEPTION_V3", "GpuRow", "gpu_rows", "format_gpu_rows", "PALM_540B",
           "model_flops_per_token", "mfu"]

# The run chapter 01 costs: Inception-v3 (~5 G multiply-adds per 299x299 image forward, Szegedy
# et al. 2015, arXiv:1512.00567; ~10 GFLOP at 2 FLOPs per multiply-add) on ImageNet-1k's
# 1,281,167 training images, an assumed 100 epochs
INCEPTION_V3 = {"forward_gflops": 10.0, "examples": 1_281_167, "epochs": 100}


@dataclass(frozen=True)
class GpuRow:
    """One GPU: dense peaks (TFLOP/s) and days for ``work`` FLOPs at a utilisation.

    ``float32_run`` is the unit a float32 TensorFlow run uses (TF32 tensor cores where the GPU
    has them, since TensorFlow enables TF32 by default; plain FP32 otherwise); ``mixed`` the FP16
    / BF16 tensor cores a mixed-precision run uses (``None``: the GPU has none).
    """

    name: str
    fp32: float
    float32_run: float
    float32_unit: str
    mixed: float | None
    days_fp32: float
    days_float32_run: float
    days_mixed: float | None


def gpu_rows(work: float | None = None, utilization: float = 0.4,
             names: Sequence[str] | None = None) -> list[GpuRow]:
    """The GPUs ``names`` (keys of ``hardware.PEAK_TFLOPS``, in that order; ``None``: every one)
    with their peaks and the days ``work`` takes at ``utilization`` of each peak."""
    work = training_flops(**INCEPTION_V3) if work is None else work
    if names is None:
        names = list(PEAK_TFLOPS)
    elif isinstance(names, str):
        raise ValueError(f"names must be a sequence of device names, got the string {names!r}")
    for name in names:
        checks.one_of("names[...]", name, PEAK_TFLOPS)
        if "fp32" not in PEAK_TFLOPS[name]:
            raise ValueError(f"{name} has no 'fp32' peak in hardware.PEAK_TFLOPS, which the "
                             "table needs")
    rows = []
    for name in names:
        peaks = PEAK_TFLOPS[name]
        unit = "tf32" if "tf32" in peaks else "fp32"
        run = peaks[unit].value
        mixed = max((peaks[p].value for p in ("bf16", "fp16") if p in peaks), default=None)
        rows.append(GpuRow(
            name, peaks["fp32"].value, run, unit.upper(), mixed,
            days_to_train(work, peaks["fp32"].value, utilization),
            days_to_train(work, run, utilization),
            None if mixed is None else days_to_train(work, mixed, utilization)))
    return rows


def _days(d: float | None) -> str:
    if d is None:
        return "-"
    if d >= 100:
        return f"{d:,.0f} d"
    return f"{d:.1f} d" if d >= 1 else f"{d * 24:.1f} h"


def format_gpu_rows(rows: list[GpuRow]) -> str:
    """The table as aligned text: peaks in TFLOP/s, then days (or hours) per unit."""
    head = ["GPU", "FP32", "float32 run", "mixed", "days FP32", "days float32 run",
            "days mixed"]
    body = [[r.name, f"{r.fp32:g}", f"{r.float32_run:g} ({r.float32_unit})",
             "-" if r.mixed is None else f"{r.mixed:g}", _days(r.days_fp32),
             _days(r.days_float32_run), _days(r.days_mixed)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
                     for line in [head, *body])



# PaLM 540B as its paper publishes it (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling
# with Pathways", arXiv:2204.02311): 540.35 B parameters, 118 layers, 48 heads of size 256
# (Table 1), sequences of 2048 tokens (Section 5), 238.3 K tokens/s on 6144 TPU v4 chips
# (Section 4.1), whose bf16 peak is 275 TFLOP/s per chip (Cloud TPU v4 documentation). The
# paper's MFU (Section 4.1, Table 3; formula in Appendix B): 46.2%, 45.7% without attention.
PALM_540B = {
    "model": {"params": 540.35e9, "layers": 118, "heads": 48, "head_dim": 256,
              "seq_len": 2048},
    "tokens_per_s": 238.3e3,
    "chips": 6144,
    "peak_flops": 275e12,
    "published_mfu": 0.462,
    "published_mfu_without_attention": 0.457,
}


def model_flops_per_token(params: float, layers: int, heads: int, head_dim: int,
                          seq_len: int, attention: bool = True) -> float:
    """Training FLOPs a dense decoder-only transformer needs per token, as PaLM's Appendix B
    counts them: ``6 N`` for the matmuls with the ``params`` weights (2 per multiply-add, forward
    plus a backward twice as costly) plus ``12 L H Q T`` for self-attention (``layers`` L,
    ``heads`` H of size ``head_dim`` Q, ``seq_len`` T); ``attention=False`` drops the second
    term. Recomputed activations are not counted: that is what makes it *model* FLOPs."""
    params = checks.positive_number("params", params)
    for name, value in (("layers", layers), ("heads", heads), ("head_dim", head_dim),
                        ("seq_len", seq_len)):
        checks.positive_int(name, value)
    if not isinstance(attention, bool):
        raise ValueError(f"attention must be True or False, got {attention!r}")
    return 6 * params + (12 * layers * heads * head_dim * seq_len if attention else 0)


def mfu(tokens_per_second: float, flops_per_token: float, chips: int,
        peak_flops_per_chip: float) -> float:
    """Model FLOPs utilisation (PaLM, Appendix B): the model FLOPs a run does per second
    (``tokens_per_second`` observed x ``flops_per_token``) over the summed peak of its
    ``chips`` (``peak_flops_per_chip`` each, FLOP/s), a fraction in (0, 1] for a real run."""
    tokens_per_second = checks.positive_number("tokens_per_second", tokens_per_second)
    flops_per_token = checks.positive_number("flops_per_token", flops_per_token)
    chips = checks.positive_int("chips", chips)
    peak = checks.positive_number("peak_flops_per_chip", peak_flops_per_chip)
    return tokens_per_second * flops_per_token / (chips * peak)
