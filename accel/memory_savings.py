"""What recomputation and mixed precision save, measured: peak memory and step time of the
gradient step of a residual MLP, plain vs ``tf.recompute_grad`` vs float16 / bfloat16 compute.

Each block is ``h + relu(h @ w1) @ w2`` with a hidden layer 4x wider than ``h``. Plain training
keeps every block's hidden activations for the backward pass; ``tf.recompute_grad`` keeps only
each block's input and recomputes the rest during the backward pass (less memory, one more
forward). Half-precision compute halves the activations; on a CPU without native float16 /
bfloat16 arithmetic it costs time instead of saving it. Peaks need the BFC allocator on CPU
(see ``accel.memory``).
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow as tf  # accel/__init__ has set TF_CPP_MIN_LOG_LEVEL already

from accel import memory
from accel.timing import format_ratios, time_fn

__all__ = ["VARIANTS", "residual_mlp", "gradient_step", "measure_variants",
           "measure_variants_anywhere", "bench_memory", "figure_memory"]

# variant -> (compute dtype, recompute?)
VARIANTS: dict[str, tuple[str, bool]] = {
    "plain": ("float32", False),
    "recompute": ("float32", True),
    "float16": ("float16", False),
    "bfloat16": ("bfloat16", False),
}


def residual_mlp(blocks: int = 8, width: int = 64, seed: int = 0) -> list[tuple]:
    """``blocks`` pairs of float32 variables ``(w1: width x 4 width, w2: 4 width x width)``."""
    if blocks < 1 or width < 1:
        raise ValueError(f"blocks and width must be >= 1, got {blocks=}, {width=}")
    rng = np.random.default_rng(seed)
    return [(tf.Variable(rng.normal(0, width**-0.5, (width, 4 * width)).astype(np.float32)),
             tf.Variable(rng.normal(0, (4 * width)**-0.5, (4 * width, width)).astype(np.float32)))
            for _ in range(blocks)]


def _block(w1, w2, dtype):
    def block(h):
        return h + tf.matmul(tf.nn.relu(tf.matmul(h, tf.cast(w1, dtype))), tf.cast(w2, dtype))
    return block


def gradient_step(params, x, variant: str = "plain") -> list[tf.Tensor]:
    """Gradients of a mean-square loss of the residual MLP on ``x`` (one ``VARIANTS`` entry)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    dtype, recompute = VARIANTS[variant]
    with tf.GradientTape() as tape:
        h = tf.cast(x, dtype)
        for w1, w2 in params:
            block = _block(w1, w2, dtype)
            h = tf.recompute_grad(block)(h) if recompute else block(h)
        loss = tf.reduce_mean(tf.square(tf.cast(h, tf.float32)))
    return tape.gradient(loss, [v for pair in params for v in pair])


def measure_variants(batch: int = 512, blocks: int = 8, width: int = 64, repeat: int = 5,
                     variants=tuple(VARIANTS)) -> dict[str, dict[str, float]]:
    """``{variant: {"peak_mib": .., "seconds": ..}}``: each variant's peak (allocator peak above
    the level before the step) and median step time, all in the same run."""
    params = residual_mlp(blocks, width)
    x = tf.constant(np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32))
    out = {}
    for name in variants:
        def run(name=name):
            return gradient_step(params, x, name)[0].numpy()
        run()
        peak, _ = memory.peak_during(run, memory.memory_device())
        out[name] = {"peak_mib": peak / memory.MIB, "seconds": time_fn(run, repeat=repeat)}
    return out


def _stats_available() -> bool:
    try:
        tf.config.experimental.get_memory_info(memory.memory_device())
    except ValueError:
        return False
    return True


def measure_variants_anywhere(**kwargs) -> dict[str, dict[str, float]]:
    """``measure_variants(**kwargs)`` here if the allocator reports statistics, else in a fresh
    Python started with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (e.g. from ``python -m accel``)."""
    if _stats_available():
        return measure_variants(**kwargs)
    from accel.memory_config import run_fresh

    code = ("import json\nfrom accel import memory_savings as s\n"
            f"print(json.dumps(s.measure_variants(**{kwargs!r})))")
    out = run_fresh(code, env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    return json.loads(out.strip().splitlines()[-1])


def _ratios(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    base = results["plain"]
    return {k: {m: v[m] / base[m] for m in v} for k, v in results.items()}


def bench_memory() -> dict:
    """Peak memory and step time: plain vs recompute vs mixed precision (ratios vs plain)."""
    results = measure_variants_anywhere(batch=1024, blocks=16, width=64, repeat=7)
    ratios = _ratios(results)
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
    names = list(memory.OPTIMIZERS)
    parts = [memory.estimate_training_memory(model, o, batch_size=256).as_dict() for o in names]
    for part in ("weights", "gradients", "optimizer_slots", "activations", "workspace", "batch"):
        vals = np.array([p[part] / memory.MIB for p in parts])
        left.bar(names, vals, bottom=bottom, label=part)
        bottom += vals
    left.set_ylabel("MiB (estimate)")
    left.set_title("MLP 512-512-512-10, batch 256")
    left.legend(fontsize=7)
    ratios = _ratios(results or measure_variants_anywhere(repeat=3))
    xs = np.arange(len(ratios))
    right.bar(xs - 0.2, [r["peak_mib"] for r in ratios.values()], 0.4, label="peak memory")
    right.bar(xs + 0.2, [r["seconds"] for r in ratios.values()], 0.4, label="step time")
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set_xticks(xs, list(ratios))
    right.set_ylabel("ratio to plain (measured, CPU)")
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig
