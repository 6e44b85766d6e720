"""Optimizer offload written by hand (the idea of ZeRO-Offload, Ren et al. 2021,
arXiv:2101.06840): the forward and backward passes run on the "accelerator" devices, while the
optimizer state (Adam's ``m``, ``v``) and the master weights live on a ``host`` device, which also
runs the update. Per step every accelerator sends its gradients to the host, the host sums them,
updates, and sends the new weights back to every accelerator.

Bytes per step with ``n`` accelerators and ``P`` bytes of weights (float32 here): each
accelerator sends ``P`` (its gradients), the host sends ``n P`` (the weights, one copy each).
``accel.costmodel.zero.offload_step`` says when a real PCIe link makes this free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import check_devices
from accel.models import mlp_apply
from accel.parallel.zero import adam_apply

__all__ = ["OffloadStep"]


class OffloadStep:
    """Data parallelism of ``mlp_apply`` over ``devices`` with Adam offloaded to ``host``.
    ``step(xs, ys)`` takes one batch part per accelerator and returns their losses (the loss is
    the mean of ``loss_fn`` over the whole batch)."""

    def __init__(self, params: Sequence, devices: Sequence[str], host: str, loss_fn,
                 learning_rate: float = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, dtype=tf.float32):
        self.devices = check_devices(devices)
        check_devices([*self.devices, host])  # the host must not be one of the accelerators
        self.host, self.loss_fn = host, loss_fn
        self.hyper = (checks.positive_number("learning_rate", learning_rate), beta_1, beta_2,
                      epsilon)
        dtype = tf.as_dtype(dtype)
        self.weights_on = []
        for d in self.devices:
            with tf.device(d):
                self.weights_on.append([tf.Variable(np.asarray(p), dtype=dtype) for p in params])
        with tf.device(host):
            self.master = [tf.Variable(np.asarray(p), dtype=dtype) for p in params]
            self.slots = [tf.Variable(tf.zeros(np.shape(p), dtype)) for p in params for _ in "mv"]
            self.iterations = tf.Variable(0.0, dtype=dtype)
        self.step = tf.function(self._step)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the variables each device holds (accelerators: the weights; host: master
        weights and Adam's slots; the step counter left out)."""
        def size(vs):
            return sum(v.shape.num_elements() * v.dtype.size for v in vs)
        out = {d: size(vs) for d, vs in zip(self.devices, self.weights_on, strict=True)}
        out[self.host] = size(self.master) + size(self.slots)
        return out

    def _step(self, xs, ys):
        batch = float(sum(int(x.shape[0]) for x in xs))  # static: no tensor crosses devices
        grads, losses = [], []
        for i, d in enumerate(self.devices):
            with tf.device(d), tf.GradientTape() as tape:
                loss = tf.reduce_sum(self.loss_fn(ys[i], mlp_apply(self.weights_on[i], xs[i])))
                loss = loss / batch
            with tf.device(d):
                grads.append(tape.gradient(loss, self.weights_on[i]))
            losses.append(loss)
        with tf.device(self.host):
            self.iterations.assign_add(1.0)
            for j, w in enumerate(self.master):
                g = tf.add_n([gs[j] for gs in grads]) if len(grads) > 1 else grads[0][j]
                w.assign(adam_apply(w, g, *self.slots[2 * j:2 * j + 2], self.iterations,
                                    *self.hyper))
        for i, d in enumerate(self.devices):
            with tf.device(d):
                for w, new in zip(self.weights_on[i], self.master, strict=True):
                    w.assign(new)
        return losses
