"""Optimizer offload written by hand (the idea of ZeRO-Offload, Ren et al. 2021,
arXiv:2101.06840): the forward and backward passes run on the "accelerator" devices, while the
optimizer state (Adam's ``m``, ``v``) and the master weights live on a ``host`` device, which also
runs the update. Per step every accelerator sends its gradients to the host, the host sums them,
updates, and sends the new weights back to every accelerator.

Bytes per step with ``n`` accelerators and ``P`` bytes of weights (float32 here): each
accelerator sends ``P`` (its gradients), the host sends ``n P`` (the weights, one copy each).
``accel.costmodel.zero.offload_step`` says when a real PCIe link makes this free.

``Offload(model, devices, host=..., loss=..., optimizer=...)`` is the same for a Keras model and
a Keras optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import check_devices
from accel.devices import parse_device
from accel.parallel.form import device_list
from accel.parallel.replicas import KerasReplicas
from accel.parallel.zero import adam_apply

__all__ = ["OffloadStep", "Offload"]


class OffloadStep:
    """Data parallelism of ``model_fn(params, x)`` (predictions) over ``devices`` with Adam
    offloaded to ``host``. ``step(xs, ys)`` takes one batch part per accelerator and returns
    their losses (the loss is the mean of ``loss_fn`` over the whole batch)."""

    def __init__(self, params: Sequence, devices: Sequence[str], host: str, loss_fn,
                 learning_rate: float = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, dtype=tf.float32, *, model_fn: Callable):
        if not callable(model_fn):
            raise ValueError(f"model_fn must be a function model_fn(params, x), got "
                             f"{model_fn!r}")
        self.devices = check_devices(devices)
        check_devices([*self.devices, host])  # the host must not be one of the accelerators
        self.host, self.loss_fn, self.model_fn = host, loss_fn, model_fn
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
                pred = self.model_fn(self.weights_on[i], xs[i])
                loss = tf.reduce_sum(self.loss_fn(ys[i], pred))
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


class Offload(KerasReplicas):
    """Optimizer offload for a Keras model and a Keras optimizer: data parallelism over
    ``devices`` (the batch split into one shard per device, each of ``accumulation_steps``
    micro-batches), each device holding a working copy of the weights and a gradient buffer,
    while the master weights and the Keras optimizer (built eagerly there, so every slot sits
    on ``host``) live on ``host``, which also runs the update. Per step every device sends its
    accumulated gradients to the host, the host sums them, updates, and sends the new weights
    back to every device.

    Optimizers: those of ``accel.parallel.form.keras_optimizer_factory`` (the same checks,
    though offload alone would not need per-element updates). ``write_back()`` (and the end of
    ``fit``) puts the host's master weights and ``devices[0]``'s BatchNorm statistics into the
    user's model; BatchNorm is per device (``accel.parallel.replicas.KerasReplicas``).
    """

    name = "offload"
    options = ("host", "accumulation_steps", "exclude_from_weight_decay", "run_eagerly")

    def __init__(self, model, devices: Sequence[str], *, host: str, loss, optimizer,
                 accumulation_steps: int | None = None,
                 exclude_from_weight_decay: Sequence[str] | None = None,
                 run_eagerly: bool = False):
        super().__init__(model, devices, loss=loss, optimizer=optimizer,
                         accumulation_steps=accumulation_steps,
                         exclude_from_weight_decay=exclude_from_weight_decay,
                         run_eagerly=run_eagerly)
        try:
            device_list([*self.devices, host])
        except ValueError as exc:
            raise ValueError(f"host {host!r} must not be one of the devices {self.devices}"
                             ) from exc
        self.host = parse_device(host).to_string()
        self._working = [self._variables(d, self._weights) for d in self.devices]
        for d in self.devices:
            with tf.device(d):
                self._grads.append([tf.Variable(tf.zeros(w.shape, w.dtype), trainable=False)
                                    for w in self._weights])
        self.master = self._variables(self.host, self._weights)
        with tf.device(self.host):
            self.optimizer = self._make_optimizer()
            self.optimizer.build(self.master)

    def held_variables(self) -> dict[str, dict[str, list]]:
        out = {d: {"weights": w + s, "grads": g, "optimizer": []} for d, w, s, g in
               zip(self.devices, self._working, self._state_vars, self._grads, strict=True)}
        out[self.host] = {"weights": list(self.master), "grads": [],
                          "optimizer": self._slots(self.optimizer)}
        return out

    def _trained_weights(self) -> list[np.ndarray]:
        return [v.numpy() for v in self.master]

    def _micro_step(self, xs, ys, scale) -> list:
        losses = []
        for i, d in enumerate(self.devices):
            loss, grads = self._local_gradients(i, self._working[i], xs[i], ys[i], scale)
            losses.append(loss)
            with tf.device(d):
                for b, g in zip(self._grads[i], grads, strict=True):
                    b.assign_add(g)
        return losses

    def _apply(self) -> None:
        with tf.device(self.host):
            grads = [tf.add_n([gs[j].read_value() for gs in self._grads])
                     for j in range(len(self.master))]
            (grads,) = self._clip([grads], [self.host], sliced=False)
            self.optimizer.apply(grads, self.master)
        for ws, d in zip(self._working, self.devices, strict=True):
            with tf.device(d):
                for w, m in zip(ws, self.master, strict=True):
                    w.assign(m.read_value())
