"""Chapter 01's cost of training: how long one training run of Inception-v3 takes on one device,
this CPU (its matmul throughput measured) against GPUs (vendor peaks, a cost model).

The arithmetic is ``accel.costmodel.steps``; the peaks with their sources
``accel.costmodel.hardware``. ``gpu_rows`` is the table the chapter prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from accel.costmodel.hardware import PEAK_TFLOPS
from accel.costmodel.steps import days_to_train, training_flops

__all__ = ["INCEPTION_V3", "GpuRow", "gpu_rows", "format_gpu_rows"]

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


def gpu_rows(work: float | None = None, utilization: float = 0.4) -> list[GpuRow]:
    """Every GPU of ``hardware.PEAK_TFLOPS`` with its peaks and the days ``work`` takes."""
    work = training_flops(**INCEPTION_V3) if work is None else work
    rows = []
    for name, peaks in PEAK_TFLOPS.items():
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

