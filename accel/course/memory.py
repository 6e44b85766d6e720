"""Chapter 04's experiments: the memory benchmark, the measured ``04_memory.png`` figure (saved by
the chapter's cell, not by ``make images``), the inter-op overlap probe and the exercise checks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.memory.estimate import MIB, OPTIMIZERS, estimate_training_memory
from accel.memory.savings import measure_variants_anywhere
from accel.memory.savings import ratios as variant_ratios
from accel.timing import format_ratios

__all__ = ["bench_memory", "figure_memory", "process_threads", "process_rss", "two_chains",
           "overlapping_pairs", "check_slot_bytes", "check_formats"]


def bench_memory(device_names: Sequence[str] = (), quick: bool = False) -> dict:
    """Peak memory and step time: plain vs recompute vs mixed precision (ratios vs plain),
    measured in a fresh process (small tensors otherwise come from chunks the allocator pooled
    for earlier work in this one, and the peaks depend on that work). ``device_names`` is
    accepted for the benchmark registry's uniform signature."""
    results = measure_variants_anywhere(fresh=True, batch=64 if quick else 1024,
                                        blocks=2 if quick else 16, width=64,
                                        repeat=1 if quick else 7)
    ratios = variant_ratios(results)
    print(format_ratios({k: v["seconds"] for k, v in results.items()}, "plain"))
    for name, r in ratios.items():
        print(f"{name:10s} peak {results[name]['peak_mib']:7.2f} MiB  {r['peak_mib']:5.2f}x plain")
    return {"results": results, "ratios": ratios}


def figure_memory(results: dict[str, dict[str, float]]):
    """Memory breakdown of a small MLP under three optimizers (left, estimated) and the measured
    memory and time ratios of recomputation and mixed precision (right, from ``results`` of
    ``accel.memory.savings.measure_variants``)."""
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
    ratios = variant_ratios(results)
    xs = np.arange(len(ratios))
    right.bar(xs - 0.2, [r["peak_mib"] for r in ratios.values()], 0.4, label="peak memory")
    right.bar(xs + 0.2, [r["seconds"] for r in ratios.values()], 0.4, label="step time")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set_xticks(xs, list(ratios))
    right.set_ylabel("ratio to plain (measured, CPU)")
    right.set_title("residual MLP step, tf.function")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def process_threads() -> int:
    """Operating-system threads of this process now (every thread of TensorFlow's pools counts)."""
    import psutil  # comes with ipykernel

    return psutil.Process().num_threads()


def process_rss() -> int:
    """Resident bytes of this process now: pages it holds, whatever its allocators think."""
    import psutil

    return psutil.Process().memory_info().rss


def two_chains(n: int = 384, depth: int = 8):
    """A TF1 graph of two independent chains of ``depth`` ``tanh(h @ h)`` steps on ``n`` x ``n``
    matrices, scopes ``chain0`` and ``chain1``; returns ``(graph, [sum0, sum1])``."""
    checks.positive_int("n", n)
    checks.positive_int("depth", depth)
    graph = tf.Graph()
    with graph.as_default():
        fetches = []
        for i in range(2):
            with tf.name_scope(f"chain{i}"):
                h = tf.random.normal((n, n), seed=i)
                for _ in range(depth):
                    h = tf.tanh(tf.matmul(h, h) / n)
                fetches.append(tf.reduce_sum(h))
    return graph, fetches


def overlapping_pairs(session, fetches) -> int:
    """Run ``fetches`` once with a full trace; count the pairs (chain0 matmul, chain1 matmul)
    whose execution intervals in the step stats intersect: 0 means the chains never ran at
    the same time."""
    meta = tf.compat.v1.RunMetadata()
    session.run(fetches, options=tf.compat.v1.RunOptions(trace_level=3), run_metadata=meta)
    spans: dict[str, list[tuple[int, int]]] = {"chain0": [], "chain1": []}
    for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
            scope = node.node_name.split("/")[0]
            if scope in spans and "matmul" in node.node_name.lower():
                start = node.all_start_micros
                spans[scope].append((start, start + node.all_end_rel_micros))
    return sum(min(a1, b1) > max(a0, b0)
               for a0, a1 in spans["chain0"] for b0, b1 in spans["chain1"])


def check_slot_bytes(answer, model) -> str:
    """Exercise 1: the bytes of the momentum optimizer's slots for ``model`` (float32)."""
    if answer is None:
        return "not yet: set answer to a number of bytes"
    right = estimate_training_memory(model, "momentum").optimizer_slots
    if answer == right:
        return "right"
    return f"not yet: {answer} is not it (hint: one slot per weight)"


def check_formats(answer) -> str:
    """Exercise 2: ``(format that keeps 1e-8 and 70000, format that keeps 1 + 1/512)``, each
    ``"float16"`` or ``"bfloat16"``."""
    if answer is None:
        return "not yet: set answer to a pair of format names"
    def back(dtype, value):
        return float(tf.cast(tf.cast(tf.constant(value, tf.float32), dtype), tf.float32))

    formats = ("float16", "bfloat16")
    in_range = [d for d in formats if all(np.isfinite(back(d, v)) and back(d, v) != 0
                                          for v in (1e-8, 7e4))]
    exact = [d for d in formats if back(d, 1 + 1 / 512) == 1 + 1 / 512]
    right = (in_range[0], exact[0])
    return "right" if tuple(answer) == right else f"not yet: {tuple(answer)} is not it"
