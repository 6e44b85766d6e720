"""Chapter 13, section 7: fewer messages and fewer bytes, measured on logical devices.

* ``packing_times``: many small gradients all-reduced by the hand ring, packed into buckets
  (``accel.collectives.packed_all_reduce``) or not;
* ``tf_packing``: the same through TensorFlow's collective all-reduce with
  ``CommunicationOptions(bytes_per_pack=...)``, its all-reduces counted in the traced graph;
* ``fp16_training``: a data-parallel regression with float32 vs float16 gradients;
* ``local_sgd_runs``: local SGD with a sync every ``k`` steps (``accel.parallel.local_sgd``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import collectives, datasets, timing
from accel.course.collectives import tf_strategy

__all__ = ["packing_times", "tf_packing", "fp16_training", "local_sgd_runs"]


def _gradient_like(device_names, tensors_per_device, size, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for d in device_names:
        with tf.device(d):
            out.append([tf.constant(rng.standard_normal(size).astype(np.float32))
                        for _ in range(tensors_per_device)])
    return out


def packing_times(device_names: Sequence[str], tensors: int = 64, size: int = 256,
                  pack_bytes: Sequence[int] = (0, 16 * 1024, 1 << 30), repeat: int = 5
                  ) -> dict:
    """``tensors`` small float32 gradients of ``size`` numbers on each device, all-reduced
    (ring) with each ``pack_bytes``: ``{pack_bytes: (median seconds, number of all-reduces)}``.
    The timed function returns every reduced tensor's sum: a result nobody fetches would let
    TensorFlow prune its all-reduce from the function, and the time would count only the rest."""
    devs = list(device_names)
    grads = _gradient_like(devs, tensors, size)
    out = {}
    for pack in pack_bytes:
        fn = tf.function(lambda g, pack=pack: [
            tf.stack([tf.reduce_sum(t) for t in ys])
            for ys in collectives.packed_all_reduce(g, devs, pack, "ring")[0]])
        calls = len(collectives.pack_buckets([4 * size] * tensors, pack))
        out[pack] = (timing.time_fn(lambda fn=fn: [v.numpy() for v in fn(grads)], repeat), calls)
    return out


def tf_packing(device_names: Sequence[str], tensors: int = 64, size: int = 256,
               bytes_per_pack: Sequence[int] = (1, 16 * 1024, 0), repeat: int = 5) -> dict:
    """TensorFlow's own packing: ``tensors`` float32 gradients of ``size`` numbers on each
    device, summed in a ``tf.function`` by the collective cross-device ops of a
    ``MirroredStrategy`` (``extended.batch_reduce_to``) with
    ``CommunicationOptions(bytes_per_pack=p)`` for each ``p``. Returns ``{p: (median seconds,
    all-reduces per device)}``, the count read from the traced graph (its ``CollectiveReduce*``
    ops over the number of devices). Raises ``RuntimeError`` if a sum differs from NumPy's."""
    devs = list(device_names)
    grads = _gradient_like(devs, tensors, size)
    strategy = tf_strategy(tuple(collectives.check_devices(devs)), "collective")
    values = [strategy.experimental_distribute_values_from_function(
        lambda ctx, k=k: grads[ctx.replica_id_in_sync_group][k]) for k in range(tensors)]
    exact = np.sum([[g.numpy() for g in per_device] for per_device in grads], axis=0)
    out = {}
    for pack in bytes_per_pack:
        options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack)
        fn = tf.function(lambda options=options: [
            strategy.experimental_local_results(r)[0] for r in strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, [(v, v) for v in values], options=options)])
        ops = fn.get_concrete_function().graph.get_operations()
        calls = sum(op.type.startswith("CollectiveReduce") for op in ops) // len(devs)
        if not np.allclose([v.numpy() for v in fn()], exact, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"bytes_per_pack={pack}: the sums differ from NumPy's")
        out[pack] = (timing.time_fn(lambda fn=fn: [v.numpy() for v in fn()], repeat), calls)
    return out


def fp16_training(device_names: Sequence[str], steps: int = 30, lr: float = 0.1,
                  seed: int = 0) -> dict:
    """A linear regression trained data-parallel over the devices (each its quarter of the
    batch, gradients all-reduced by ring) with the gradients sent as float32 and as float16:
    ``{"float32": [losses], "float16": [losses]}``."""
    devs = list(device_names)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64 * len(devs), 16)).astype(np.float32)
    y = x @ rng.standard_normal((16, 1)).astype(np.float32) + 0.1
    out = {}
    for name, send in (("float32", lambda g: collectives.all_reduce(g, devs, "ring", "mean")),
                       ("float16", lambda g: [v / len(devs) for v in
                                              collectives.compressed_all_reduce(g, devs)])):
        w = np.zeros((16, 1), np.float32)
        losses = []
        for _ in range(steps):
            grads = []
            for xs, ys, d in zip(np.split(x, len(devs)), np.split(y, len(devs)), devs,
                                 strict=True):
                with tf.device(d):
                    grads.append(tf.constant(2 * xs.T @ (xs @ w - ys) / len(xs)))
            g = send(grads)[0].numpy()
            w = w - lr * g
            losses.append(float(np.mean((x @ w - y) ** 2)))
        out[name] = losses
    return out


def local_sgd_runs(device_names: Sequence[str], everys: Sequence[int] = (1, 2, 4, 8),
                   steps: int = 16, lr: float = 0.05, seed: int = 0) -> dict:
    """Local SGD on a linear regression, one shard of 16 examples per device and step, for each
    ``every``: ``{every: LocalSGDResult}`` (same examples, same steps; only the syncs differ)."""
    from accel.parallel.local_sgd import local_sgd
    from accel.training import squared_error

    devs = list(device_names)
    n, b = len(devs), 16
    x, y, _ = datasets.regression(n * b * steps, 8, 4, seed=seed)
    shards = [[(x[(n * t + i) * b:(n * t + i + 1) * b], y[(n * t + i) * b:(n * t + i + 1) * b])
               for t in range(steps)] for i in range(n)]
    params = [np.zeros((8, 4), np.float32), np.zeros(4, np.float32)]
    return {k: local_sgd(lambda p, xb: xb @ p[0] + p[1], squared_error, params, shards, devs,
                         every=k, steps=steps, learning_rate=lr, x_eval=x, y_eval=y)
            for k in everys}
