"""What recomputation and mixed precision save, measured: peak memory and step time of the
gradient step of a residual MLP, plain vs ``tf.recompute_grad`` vs float16 / bfloat16 compute.

Each block is ``h + relu(h @ w1) @ w2`` with a hidden layer 4x wider than ``h``. Plain training
keeps every block's hidden activations for the backward pass; ``tf.recompute_grad`` keeps only
each block's input and recomputes the rest during the backward pass (less memory, one more
forward: a forward is about a third of forward + backward, so about 4/3 of the work).
Half-precision compute stores each activation in half the bytes, but the step also keeps
half-precision copies of the weights. What it does to time depends on the kernels: TensorFlow's
own CPU kernels (the course runs them: ``accel.course`` sets ``TF_ENABLE_ONEDNN_OPTS=0``) gain
nothing from float16 / bfloat16, so the casts make the step slower, while oneDNN on a CPU with
bfloat16 instructions (AVX-512 BF16, AMX) and GPUs' tensor cores run half precision faster (a
one-thread 1024 x 1024 bfloat16 matmul, TF 2.21 on a Xeon with AMX: 7.5 ms with oneDNN, against
18.8 ms in float32; 23.2 against 22.4 ms without oneDNN). ``measure_peaks`` measures memory
only. Steps are timed as ``tf.function``s (eager dispatch overhead would distort the ratios), the
variants interleaved round by round, each variant's fastest round kept (the least disturbed by
other load). Peaks need the BFC allocator on CPU (see
``accel.memory.estimate``).
"""

from __future__ import annotations

import json
import time

import numpy as np
import tensorflow as tf

from accel import checks, procs
from accel.memory.estimate import MIB
from accel.memory.measure import memory_device, peak_during

__all__ = ["VARIANTS", "residual_mlp", "gradient_step", "measure_variants", "measure_peaks",
           "forward_seconds", "measure_variants_anywhere", "ratios"]

# variant -> (compute dtype, recompute?)
VARIANTS: dict[str, tuple[str, bool]] = {
    "plain": ("float32", False),
    "recompute": ("float32", True),
    "float16": ("float16", False),
    "bfloat16": ("bfloat16", False),
}


def residual_mlp(blocks: int = 8, width: int = 64, seed: int = 0) -> list[tuple]:
    """``blocks`` pairs of float32 variables ``(w1: width x 4 width, w2: 4 width x width)``."""
    checks.positive_int("blocks", blocks)
    checks.positive_int("width", width)
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
    checks.one_of("variant", variant, VARIANTS)
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
    the level before the step) and step time, all in the same run. Each step is a traced
    ``tf.function``; ``repeat`` rounds run every variant once, and a variant's time is its
    fastest round."""
    checks.positive_int("repeat", repeat)
    for name in variants:
        checks.one_of("variant", name, VARIANTS)
    params = residual_mlp(blocks, width)
    x = tf.constant(np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32))
    steps = {name: tf.function(lambda name=name: gradient_step(params, x, name), autograph=False)
             for name in variants}
    out = {}
    for name, step in steps.items():
        step()[0].numpy()  # trace once
        peak, _ = peak_during(lambda step=step: step()[0].numpy(), memory_device())
        out[name] = {"peak_mib": peak / MIB, "seconds": float("inf")}
    for _ in range(repeat):
        for name, step in steps.items():
            start = time.perf_counter()
            step()[0].numpy()
            out[name]["seconds"] = min(out[name]["seconds"], time.perf_counter() - start)
    return out


def measure_peaks(batch: int = 512, blocks: int = 8, width: int = 64,
                  variants=tuple(VARIANTS)) -> dict[str, float]:
    """``{variant: peak MiB}``: the allocator's peak above the level before one step of each
    variant, measured as ``measure_variants`` measures it (a traced ``tf.function``, one call
    first), without timing anything."""
    for name in variants:
        checks.one_of("variant", name, VARIANTS)
    params = residual_mlp(blocks, width)
    x = tf.constant(np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32))
    out = {}
    for name in variants:
        step = tf.function(lambda name=name: gradient_step(params, x, name), autograph=False)
        step()[0].numpy()  # trace once
        peak, _ = peak_during(lambda step=step: step()[0].numpy(), memory_device())
        out[name] = peak / MIB
    return out


def forward_seconds(batch: int = 512, blocks: int = 8, width: int = 64, repeat: int = 5) -> float:
    """The forward pass and loss alone (no tape) of ``measure_variants``' plain step, same model
    and batch, timed the same way (a traced ``tf.function``, fastest of ``repeat`` runs): what
    recomputation adds to a step, measured instead of assumed."""
    checks.positive_int("repeat", repeat)
    params = residual_mlp(blocks, width)
    x = tf.constant(np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32))

    @tf.function(autograph=False)
    def forward():
        h = x
        for w1, w2 in params:
            h = _block(w1, w2, "float32")(h)
        return tf.reduce_mean(tf.square(h))

    forward().numpy()  # trace once
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        forward().numpy()
        best = min(best, time.perf_counter() - start)
    return best


def _stats_available() -> bool:
    try:
        tf.config.experimental.get_memory_info(memory_device())
    except ValueError:
        return False
    return True


def measure_variants_anywhere(fresh: bool = False, **kwargs) -> dict[str, dict[str, float]]:
    """``measure_variants(**kwargs)`` here if the allocator reports statistics, else in a fresh
    Python started with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (e.g. from ``python -m accel``).
    ``fresh=True`` always uses a fresh Python: small tensors come from chunks the allocator
    pooled earlier, so a peak measured after other work depends on that work. The fresh
    Python runs its ops on one inter-op thread: with several, independent ops start in any
    order and a step's peak changes from run to run (plain 1.23 or 0.81 MiB at batch 256, 4
    blocks of width 32); one order makes the peaks repeatable."""
    if _stats_available() and not fresh:
        return measure_variants(**kwargs)
    code = ("import json\nimport tensorflow as tf\n"
            "tf.config.threading.set_inter_op_parallelism_threads(1)  # one op order: see doc\n"
            "from accel.memory import savings as s\n"
            f"print(json.dumps(s.measure_variants(**{kwargs!r})))")
    out = procs.run_python(code, env={"TF_CPU_ALLOCATOR_USE_BFC": "true"}, warm=True)
    return json.loads(out.strip().splitlines()[-1])


def ratios(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``measure_variants``' results divided by the ``"plain"`` variant's (memory and time)."""
    base = results["plain"]
    return {k: {m: v[m] / base[m] for m in v} for k, v in results.items()}
