"""Chapter 04's experiments: the memory benchmark and the ``04_memory.png`` figure."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel.memory.estimate import MIB, OPTIMIZERS, estimate_training_memory
from accel.memory.savings import measure_variants_anywhere
from accel.memory.savings import ratios as variant_ratios
from accel.timing import format_ratios

__all__ = ["bench_memory", "figure_memory"]


def bench_memory(device_names: Sequence[str] = (), quick: bool = False) -> dict:
    """Peak memory and step time: plain vs recompute vs mixed precision (ratios vs plain).
    Runs on the memory device (``accel.memory.measure.memory_device``); ``device_names`` is
    accepted for the benchmark registry's uniform signature."""
    results = measure_variants_anywhere(batch=64 if quick else 1024, blocks=2 if quick else 16,
                                        width=64, repeat=1 if quick else 7)
    ratios = variant_ratios(results)
    print(format_ratios({k: v["seconds"] for k, v in results.items()}, "plain"))
    for name, r in ratios.items():
        print(f"{name:10s} peak {results[name]['peak_mib']:7.2f} MiB  {r['peak_mib']:5.2f}x plain")
    return {"results": results, "ratios": ratios}


def figure_memory(results: dict[str, dict[str, float]] | None = None):
    """Memory breakdown of a small MLP under three optimizers (left) and the measured memory and
    time ratios of recomputation and mixed precision (right)."""
    import matplotlib.pyplot as plt

    model = tf.keras.Sequential([tf.keras.Input((512,)), tf.keras.layers.Dense(512, "relu"),
                                 tf.keras.layers.Dense(512, "relu"), tf.keras.layers.Dense(10)])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    bottom = np.zeros(3)
    names = list(OPTIMIZERS)
    parts = [estimate_training_memory(model, o, batch_size=256).as_dict() for o in names]
    for part in ("weights", "gradients", "optimizer_slots", "activations", "workspace", "batch"):
        vals = np.array([p[part] / MIB for p in parts])
        left.bar(names, vals, bottom=bottom, label=part)
        bottom += vals
    left.set_ylabel("MiB (estimate)")
    left.set_title("MLP 512-512-512-10, batch 256")
    left.legend(fontsize=7)
    ratios = variant_ratios(results or measure_variants_anywhere(repeat=3))
    xs = np.arange(len(ratios))
    right.bar(xs - 0.2, [r["peak_mib"] for r in ratios.values()], 0.4, label="peak memory")
    right.bar(xs + 0.2, [r["seconds"] for r in ratios.values()], 0.4, label="step time")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set_xticks(xs, list(ratios))
    right.set_ylabel("ratio to plain (measured, CPU)")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig
