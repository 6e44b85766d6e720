"""The scale of the problem: how long a real training run takes on one device.

The seed's figure: Inception-v3 trained on one machine to 78% top-1 took close to half a year
(Google Research blog, TensorFlow 0.8 announcement, April 2016). ``training_flops`` recomputes
the work from first principles so the same estimate can be made for this machine, with its
matmul throughput measured live, and for GPUs at their vendor peak figures (labelled as such).
"""

from __future__ import annotations

import tensorflow as tf

from accel.timing import time_fn

__all__ = ["PEAK_TFLOPS", "training_flops", "measure_matmul_tflops", "days_to_train",
           "figure_scale"]

# Vendor peak dense FP32 throughput (TFLOP/s); real training reaches a fraction of it.
PEAK_TFLOPS = {"NVIDIA K520 (2013)": 2.45, "NVIDIA V100": 15.7, "NVIDIA A100": 19.5,
               "NVIDIA H100 SXM": 67.0}


def training_flops(forward_gflops: float = 5.7, examples: int = 1_281_167,
                   epochs: int = 100) -> float:
    """FLOPs of a training run: forward + backward ~= 3x forward, per example, per epoch.

    Defaults: Inception-v3 (~5.7 GFLOPs per 299x299 image forward, i.e. 2 FLOPs per
    multiply-add), ImageNet-1k's 1,281,167 training images, 100 epochs.
    """
    if forward_gflops <= 0 or examples < 1 or epochs < 1:
        raise ValueError(f"need positive inputs, got {forward_gflops=}, {examples=}, {epochs=}")
    return 3.0 * forward_gflops * 1e9 * examples * epochs


def measure_matmul_tflops(n: int = 1024, device: str = "/cpu:0", repeat: int = 5) -> float:
    """Measured float32 matmul throughput of ``device`` in TFLOP/s (2 n^3 FLOPs per product)."""
    with tf.device(device):
        a = tf.random.stateless_normal((n, n), seed=(0, 1))
        b = tf.random.stateless_normal((n, n), seed=(0, 2))
        seconds = time_fn(lambda: tf.matmul(a, b).numpy(), repeat=repeat)
    return 2 * n**3 / seconds / 1e12


def days_to_train(flops: float, tflops: float, utilization: float = 1.0) -> float:
    """Days needed to do ``flops`` of work at ``tflops`` x ``utilization``."""
    if tflops <= 0 or not 0 < utilization <= 1:
        raise ValueError(f"need tflops > 0 and 0 < utilization <= 1, got {tflops}, {utilization}")
    return flops / (tflops * 1e12 * utilization) / 86400


def figure_scale(measured_tflops: float | None = None, utilization: float = 0.4):
    """Days to train Inception-v3 on ImageNet: this CPU (measured) vs GPUs (peak x utilization)."""
    import matplotlib.pyplot as plt

    tflops = {"this CPU (measured)": measured_tflops or measure_matmul_tflops(), **PEAK_TFLOPS}
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
                  f"GPUs at {utilization:.0%} of peak")
    ax.set_title("Inception-v3 on ImageNet, 100 epochs, one device")
    fig.tight_layout()
    return fig
