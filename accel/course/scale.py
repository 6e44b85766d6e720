"""Chapter 01's figure: how long one training run of Inception-v3 takes on one device, this CPU
(its matmul throughput measured) against GPUs (vendor peaks, a cost model). The arithmetic is
``accel.costmodel.steps``; the figures with their sources ``accel.costmodel.hardware``.
"""

from __future__ import annotations

from accel.costmodel.hardware import PEAK_TFLOPS
from accel.costmodel.steps import days_to_train, training_flops
from accel.timing import measure_matmul_tflops

__all__ = ["figure_scale"]


def figure_scale(measured_tflops: float | None = None, utilization: float = 0.4):
    """Days to train Inception-v3 on ImageNet: this CPU (measured) vs GPUs (peak x utilization)."""
    import matplotlib.pyplot as plt

    tflops = {"this CPU (measured)": measured_tflops or measure_matmul_tflops(),
              **{name: peaks["fp32"].value for name, peaks in PEAK_TFLOPS.items()}}
    work = training_flops()
    days = {k: days_to_train(work, v, 1.0 if "measured" in k else utilization)
            for k, v in tflops.items()}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(list(days), list(days.values()), color="#4C72B0")
    ax.set_xscale("log")
    for i, d in enumerate(days.values()):
        ax.text(d, i, f" {d:,.0f} d" if d >= 1 else f" {d * 24:.1f} h", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"days for {work / 1e18:.1f} EFLOP (log scale); "
                  f"GPUs at {utilization:.0%} of FP32 peak (a model)")
    ax.set_title("Inception-v3 on ImageNet, 100 epochs, one device")
    fig.tight_layout()
    return fig
