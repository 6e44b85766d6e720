"""Local SGD: every replica takes ``every`` plain SGD steps on its own shard of the data, then the
replicas average their weights with one all-reduce (a hand-written ring, ``accel.collectives``).

With ``every=1`` this is synchronous data parallelism (for plain SGD, averaging the weights after
one step is averaging the gradients before it); with ``every=k`` the replicas exchange ``k`` times
fewer bytes and drift apart in between, which costs some convergence per example. The result
counts the synchronisations and the bytes each device sent, from the formula checked against the
executed graphs in ``accel.collectives.counting``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from accel import checks, collectives

__all__ = ["LocalSGDResult", "local_sgd"]


@dataclass
class LocalSGDResult:
    """Averaged weights after the last synchronisation, the full-data loss after each one, how
    many all-reduces ran, and the bytes each device sent in them."""

    params: list[np.ndarray]
    losses: list[float]
    syncs: int
    bytes_per_device: int


def _sgd_step(model_fn, loss_fn, variables, x, y, learning_rate, device) -> None:
    with tf.device(device):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, model_fn(variables, x)))
        for v, g in zip(variables, tape.gradient(loss, variables), strict=True):
            v.assign_sub(learning_rate * g)


def local_sgd(model_fn: Callable, loss_fn: Callable, params: Sequence[np.ndarray],
              shards: Sequence[Sequence[tuple]], devices: Sequence[str], *, every: int,
              steps: int, learning_rate: float, x_eval=None, y_eval=None) -> LocalSGDResult:
    """Train ``model_fn(params, x)`` from ``params``: replica ``i`` on ``devices[i]`` takes step
    ``t`` on ``shards[i][t % len(shards[i])]`` (an ``(x, y)`` pair); after every ``every``
    steps the weights are averaged over the replicas by a ring all-reduce. ``steps`` must be a
    multiple of ``every`` (the run ends synchronised). ``x_eval``, ``y_eval``: the data whose
    mean loss is recorded after each synchronisation."""
    devices = collectives.check_devices(devices)
    checks.positive_int("every", every)
    checks.positive_int("steps", steps)
    if checks.learning_rate(learning_rate) is None:
        raise ValueError(f"learning_rate must be a number > 0, got {learning_rate!r}")
    if len(shards) != len(devices):
        raise ValueError(f"got {len(shards)} shards for {len(devices)} devices: one per device")
    if steps % every:
        raise ValueError(f"steps={steps} is not a multiple of every={every}: the run must end "
                         "on a synchronisation")
    replicas = []
    for d in devices:
        with tf.device(d):
            replicas.append([tf.Variable(np.asarray(p)) for p in params])
    losses, syncs, sent = [], 0, 0
    for t in range(steps):
        for i, d in enumerate(devices):
            x, y = shards[i][t % len(shards[i])]
            _sgd_step(model_fn, loss_fn, replicas[i], x, y, learning_rate, d)
        if (t + 1) % every:
            continue
        for k in range(len(params)):
            tensors = [tf.identity(r[k]) for r in replicas]
            for r, mean in zip(replicas, collectives.all_reduce(tensors, devices, "ring", "mean"),
                               strict=True):
                r[k].assign(mean)
            nbytes = int(np.prod(params[k].shape)) * tensors[0].dtype.size
            sent += max(collectives.all_reduce_bytes_per_device(
                nbytes, len(devices), "ring", itemsize=tensors[0].dtype.size))
        syncs += 1
        if x_eval is not None:
            losses.append(float(tf.reduce_mean(loss_fn(y_eval, model_fn(replicas[0], x_eval)))))
    return LocalSGDResult([v.numpy() for v in replicas[0]], losses, syncs, sent)
