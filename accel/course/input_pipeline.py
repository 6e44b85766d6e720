"""Chapter 08's input-pipeline experiment: is a training step input-bound or compute-bound?

* ``slow_batches(x, y, batch_size, delay_s, ...)``: batches whose ``map`` function costs
  ``delay_s`` seconds per batch (a ``tf.py_function`` that sleeps: a stand-in for reading from a
  slow disk or decoding), with the ``tf.data`` options under study: parallel ``map``, ``cache``,
  ``prefetch``; ``calls`` counts how often the map function really ran;
* ``verdict(input_s, compute_s)``: the pure rule, "input-bound" when feeding a step takes longer
  than computing it;
* ``measure_input(...)``: seconds per step of the compute alone, the input alone, and training
  fed by each pipeline variant, all in one run; ``bench_input``: the same as a benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import checks, datasets, models
from accel.timing import format_ratios
from accel.training import squared_error

__all__ = ["VARIANTS", "slow_batches", "verdict", "measure_input", "bench_input"]

VARIANTS = {  # name -> (parallel map, prefetch, cache)
    "map": (False, False, False),
    "map + prefetch": (False, True, False),
    "parallel map + prefetch": (True, True, False),
    "cache + prefetch (epoch 2)": (False, True, True),
}


def slow_batches(x: np.ndarray, y: np.ndarray, batch_size: int, delay_s: float,
                 parallel: bool = False, prefetch: bool = False, cache: bool = False,
                 parallel_calls: int = 4, calls: list | None = None) -> tf.data.Dataset:
    """``(x, y)`` in batches of ``batch_size``, each passed through a map that takes ``delay_s``.

    ``parallel``: ``map(..., num_parallel_calls=parallel_calls)`` (several batches in flight,
    output order kept); ``cache``: ``.cache()`` after the map (the second epoch skips it);
    ``prefetch``: ``.prefetch(tf.data.AUTOTUNE)`` at the end (the next batch is prepared while
    the current step runs). Each run of the map function appends 1 to ``calls`` if given.
    """
    checks.positive_int("batch_size", batch_size)
    checks.non_negative_number("delay_s", delay_s)
    checks.positive_int("parallel_calls", parallel_calls)

    def work(xb):
        time.sleep(delay_s)
        if calls is not None:
            calls.append(1)
        return xb

    def slow_map(xb, yb):
        out = tf.py_function(work, [xb], tf.float32)
        out.set_shape(xb.shape)
        return out, yb

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=True)
    ds = ds.map(slow_map, num_parallel_calls=parallel_calls if parallel else None)
    if cache:
        ds = ds.cache()
    if prefetch:
        ds = ds.prefetch(tf.data.AUTOTUNE)
    return ds


def verdict(input_s: float, compute_s: float) -> str:
    """``"input-bound"`` if producing one batch (``input_s``) takes longer than one training
    step on data already in memory (``compute_s``), else ``"compute-bound"``."""
    checks.non_negative_number("input_s", input_s)
    checks.non_negative_number("compute_s", compute_s)
    return "input-bound" if input_s > compute_s else "compute-bound"


def _per_step(fn, steps: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / steps


def measure_input(device: str, batch_size: int = 256, steps: int = 12, delay_s: float = 0.02,
                  sizes: Sequence[int] = (64, 512, 512, 1)) -> dict:
    """Seconds per step on ``device``: ``compute`` (training on batches already in memory),
    ``input`` (iterating the plain map pipeline, no training) and each of ``VARIANTS`` feeding
    the same training step. Returns ``{"seconds": {...}, "verdict": ...}``."""
    x, y, _ = datasets.regression(batch_size * steps, sizes[0], sizes[-1], seed=0)
    with tf.device(device):
        model = models.keras_mlp(list(sizes))
    optimizer = tf.keras.optimizers.SGD(0.001)

    @tf.function
    def train(xb, yb):
        with tf.device(device), tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(yb, model(xb, training=True)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_weights),
                                      model.trainable_weights, strict=True))
        return loss

    def run(ds):
        for xb, yb in ds:
            train(xb, yb)

    in_memory = list(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size))
    run(in_memory[:2])  # trace the step once
    seconds = {"compute": _per_step(lambda: run(in_memory), steps),
               "input": _per_step(lambda: [None for _ in slow_batches(x, y, batch_size, delay_s)],
                                  steps)}
    for name, (parallel, prefetch, cache) in VARIANTS.items():
        ds = slow_batches(x, y, batch_size, delay_s, parallel, prefetch, cache)
        if cache:
            run(ds)  # epoch 1 fills the cache
        seconds[name] = _per_step(lambda ds=ds: run(ds), steps)
    return {"seconds": seconds, "verdict": verdict(seconds["input"], seconds["compute"])}


def bench_input(device_names: Sequence[str], quick: bool = False) -> dict:
    """The input-pipeline variants against compute alone on the first device: prints each
    variant's step time as a ratio to the compute-only step, measured in this run."""
    res = measure_input(device_names[0], batch_size=32 if quick else 256,
                        steps=4 if quick else 12, delay_s=0.005 if quick else 0.02)
    seconds = res["seconds"]
    print(format_ratios(seconds, "compute"))
    print("verdict without prefetch or parallelism:", res["verdict"])
    return {f"{k}/compute": v / seconds["compute"] for k, v in seconds.items()}
