"""Optimizer offload written by hand, as ZeRO-Offload does it (Ren et al. 2021, "ZeRO-Offload:
Democratizing Billion-Scale Model Training", USENIX ATC, arXiv:2101.06840): the forward and
backward passes run on the accelerators, while the master weights and the optimizer's state live
on a ``host`` device, which also runs the update. ZeRO-Offload is built on ZeRO stage 2
(section 4.2, "Scaling to Multi-GPUs"): the parameters are flattened and cut into one partition
per accelerator; each accelerator reduce-scatters the gradients, so it holds the sum of ITS
partition only, and offloads that partition to the host; the host keeps, for each
accelerator's partition, the master weights and Adam's ``m`` and ``v`` and updates it (each
data-parallel process its own partition, in parallel); the updated partition goes back to its
accelerator, and an all-gather among the accelerators rebuilds the full weights.

Bytes per step with ``n`` accelerators and ``P`` bytes of (padded) weights, float32 here: each
accelerator sends ``(n-1)/n P`` in the reduce-scatter, ``P/n`` (its gradient partition) to the
host and ``(n-1)/n P`` in the all-gather; the host sends each accelerator its partition,
``P/n``, ``P`` in all. What crosses the host link per accelerator is ``P/n`` each way: the
paper's single-GPU volume (section 3.3: fp16 gradients down, fp16 parameters up, ``2M`` each
for ``M`` parameters) divided by ``n``. ``accel.costmodel.zero.zero_offload_step`` says when a
real PCIe link and the host's Adam pass hide under the compute.

``Offload(model, devices, host=..., loss=..., optimizer=...)`` is the same for a Keras model and
a Keras optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import all_gather, check_devices, reduce_scatter
from accel.devices import parse_device
from accel.parallel.form import device_list
from accel.parallel.replicas import KerasReplicas
from accel.parallel.zero import adam_apply

__all__ = ["OffloadStep", "Offload"]


def _padded(t, n: int):
    """``t`` flattened and zero-padded to a multiple of ``n`` (``Zero`` cuts variables so too)."""
    flat = tf.reshape(t, [-1])
    return tf.pad(flat, [[0, -int(flat.shape[0]) % n]])


class OffloadStep:
    """Data parallelism of ``model_fn(params, x)`` (predictions) over ``devices`` with Adam
    offloaded to ``host``, partitioned as ZeRO-Offload partitions it (built on ZeRO stage 2).

    The parameters are flattened into one vector, zero-padded to a multiple of ``n =
    len(devices)``; partition ``i`` (a contiguous ``1/n`` of it) belongs to device ``i``. Each
    device keeps the full weights (``weights_on[i]``, the flat vector); the host keeps, per
    device, that device's partition of the master weights (``master[i]``) and Adam's two
    moments (``slots[i]``). ``step(xs, ys)`` takes one batch part per device (placed there) and
    returns their losses (the loss is the mean of ``loss_fn`` over the whole batch): each
    device's gradient, reduce-scattered; partition ``i`` of the sum to the host; Adam there on
    each partition; partition ``i`` back to device ``i``; all-gathered on the devices."""

    def __init__(self, params: Sequence, devices: Sequence[str], host: str, loss_fn,
                 learning_rate: float = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, dtype=tf.float32, *, model_fn: Callable):
        if not callable(model_fn):
            raise ValueError(f"model_fn must be a function model_fn(params, x), got "
                             f"{model_fn!r}")
        self.devices = check_devices(devices)
        check_devices([*self.devices, host])  # the host must not be one of the accelerators
        self.n = n = len(self.devices)
        self.host, self.loss_fn, self.model_fn = host, loss_fn, model_fn
        self.hyper = (checks.positive_number("learning_rate", learning_rate), beta_1, beta_2,
                      epsilon)
        dtype = tf.as_dtype(dtype)
        self.shapes = [np.shape(p) for p in params]
        self.params = sum(int(np.size(p)) for p in params)
        flat = np.concatenate([np.ravel(p) for p in params])
        flat = np.pad(flat, (0, -len(flat) % n))
        self.padded_params = len(flat)
        parts = np.split(flat, n)
        self.weights_on, self.master, self.slots = [], [], []
        for d in self.devices:
            with tf.device(d):
                self.weights_on.append(tf.Variable(flat, dtype=dtype))
        with tf.device(host):
            for part in parts:
                self.master.append(tf.Variable(part, dtype=dtype))
                self.slots.append([tf.Variable(tf.zeros(len(part), dtype)) for _ in "mv"])
            self.iterations = tf.Variable(0.0, dtype=dtype)
        self.step = tf.function(self._step, autograph=False)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the variables each device holds (accelerators: the full weights; host:
        every partition's master weights and Adam's slots; the step counter left out)."""
        def size(vs):
            return sum(v.shape.num_elements() * v.dtype.size for v in vs)
        out = {d: size([w]) for d, w in zip(self.devices, self.weights_on, strict=True)}
        out[self.host] = size(self.master) + size([s for pair in self.slots for s in pair])
        return out

    def weights(self, device: int = 0) -> list[np.ndarray]:
        """The full weights as arrays of the parameters' shapes (device ``device``'s copy)."""
        flat, out, at = self.weights_on[device].numpy(), [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            out.append(flat[at:at + size].reshape(shape))
            at += size
        return out

    def _unflat(self, flat) -> list:
        out, at = [], 0
        for shape in self.shapes:
            size = int(np.prod(shape))
            out.append(tf.reshape(flat[at:at + size], shape))
            at += size
        return out

    def _step(self, xs, ys):
        batch = float(sum(int(x.shape[0]) for x in xs))  # static: no tensor crosses devices
        grads, losses = [], []
        for i, d in enumerate(self.devices):
            with tf.device(d):
                with tf.GradientTape() as tape:
                    pred = self.model_fn(self._unflat(self.weights_on[i]), xs[i])
                    loss = tf.reduce_sum(self.loss_fn(ys[i], pred)) / batch
                grads.append(tape.gradient(loss, self.weights_on[i]))
            losses.append(loss)
        mine = reduce_scatter(grads, self.devices)  # device i: partition i of the sum
        with tf.device(self.host):
            self.iterations.assign_add(1.0)
            for i in range(self.n):  # the partition offloaded; the host's Adam on it
                g = tf.identity(mine[i])
                self.master[i].assign(adam_apply(self.master[i], g, *self.slots[i],
                                                 self.iterations, *self.hyper))
        back = []
        for i, d in enumerate(self.devices):
            with tf.device(d):
                back.append(tf.identity(self.master[i].read_value()))  # partition i comes back
        full = all_gather(back, self.devices)
        for i, d in enumerate(self.devices):
            with tf.device(d):
                self.weights_on[i].assign(full[i])
        return losses


class Offload(KerasReplicas):
    """Optimizer offload for a Keras model and a Keras optimizer, partitioned as ZeRO-Offload
    does it (built on ZeRO stage 2): data parallelism over ``devices`` (the batch split into one
    shard per device, each of ``accumulation_steps`` micro-batches), each device holding a
    working copy of the full weights (and its own BatchNorm statistics). Each trainable
    variable is flattened and zero-padded to a multiple of ``n = len(devices)``; slice ``i``
    of each belongs to device ``i``. On ``host``, per device: that device's slices of the
    master weights, of the gradient buffer and a Keras optimizer built eagerly on its slices
    (``optimizers[i]``: every slot sits on ``host``), as each data-parallel process of
    ZeRO-Offload keeps its partition in host memory and runs its own CPU Adam on it.

    Per micro-batch every device computes its gradients; they are reduce-scattered among the
    devices and each device's slice is added into its buffer on the host (ZeRO 2 keeps only
    its slice, so it exchanges every micro-batch). Per step the host updates every partition,
    sends slice ``i`` back to device ``i``, and an all-gather among the devices rebuilds the
    full weights. Optimizers: those of ``accel.parallel.form.keras_optimizer_factory`` (the
    update is per element, so a partition's update equals the whole variable's);
    ``global_clipnorm`` and a ``LossScaleOptimizer``'s verdict are judged over all partitions
    at once on the host. ``write_back()`` (and the end of ``fit``) puts the master weights
    (joined) and ``devices[0]``'s BatchNorm statistics into the user's model.
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
        n = self.n
        self.sizes = [int(np.prod(w.shape)) for w in self._weights]
        flats = [_padded(w.value, n).numpy() for w in self._weights]
        self._working = [self._variables(d, self._weights) for d in self.devices]
        self._grads = [[] for _ in self.devices]  # no buffer on the devices: on the host
        self.master, self.host_grads, self.optimizers = [], [], []
        for i in range(n):
            self.master.append(self._variables(self.host, self._weights,
                                               [np.split(f, n)[i] for f in flats]))
            with tf.device(self.host):
                self.host_grads.append([tf.Variable(tf.zeros(len(f) // n, w.dtype),
                                                    trainable=False)
                                        for f, w in zip(flats, self._weights, strict=True)])
                opt = self._make_optimizer()
                opt.build(self.master[i])
            self.optimizers.append(opt)

    @property
    def optimizer(self):
        """The first partition's optimizer: every partition's has the same configuration and
        step count (and, under loss scaling, the same scale: one verdict for all); the others
        are ``optimizers[1:]``."""
        return self.optimizers[0]

    def held_variables(self) -> dict[str, dict[str, list]]:
        out = {d: {"weights": w + s, "grads": [], "optimizer": []} for d, w, s in
               zip(self.devices, self._working, self._state_vars, strict=True)}
        out[self.host] = {"weights": [v for part in self.master for v in part],
                          "grads": [g for part in self.host_grads for g in part],
                          "optimizer": [v for opt in self.optimizers for v in self._slots(opt)]}
        return out

    def _trained_weights(self) -> list[np.ndarray]:
        return [np.concatenate([part[j].numpy() for part in self.master])[:size]
                .reshape(w.shape)
                for j, (w, size) in enumerate(zip(self._weights, self.sizes, strict=True))]

    def _unflat(self, flat, j: int):
        return tf.reshape(flat[:self.sizes[j]], self._weights[j].shape)

    def _micro_step(self, xs, ys, scale) -> list:
        losses, flats = [], []
        for i, d in enumerate(self.devices):
            loss, grads = self._local_gradients(i, self._working[i], xs[i], ys[i], scale)
            losses.append(loss)
            with tf.device(d):
                flats.append([_padded(g, self.n) for g in grads])
        for j in range(len(self._weights)):
            parts = reduce_scatter([f[j] for f in flats], self.devices)
            with tf.device(self.host):  # device i's slice of the sum, offloaded
                for i in range(self.n):
                    self.host_grads[i][j].assign_add(parts[i])
        return losses

    def _apply(self) -> None:
        n, count = self.n, len(self._weights)
        with tf.device(self.host):
            grads = [g.read_value() for part in self.host_grads for g in part]
            (grads,) = self._clip([grads], [self.host], sliced=False)  # one verdict, one norm
            for i in range(n):
                self.optimizers[i].apply(grads[i * count:(i + 1) * count], self.master[i])
            for part in self.host_grads:
                for g in part:
                    g.assign(tf.zeros_like(g))
        for j in range(count):
            back = []
            for i, d in enumerate(self.devices):
                with tf.device(d):  # slice i comes back to device i
                    back.append(tf.identity(self.master[i][j].read_value()))
            full = all_gather(back, self.devices)
            for i, d in enumerate(self.devices):
                with tf.device(d):
                    self._working[i][j].assign(self._unflat(full[i], j))
