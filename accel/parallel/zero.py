"""ZeRO stages 0-3 written by hand: data parallelism with Adam whose optimizer state (stage 1),
gradients (stage 2) and weights (stage 3) are sharded over the devices (Rajbhandari et al. 2019,
arXiv:1910.02054). Stage 0 is plain data parallelism, the baseline.

Layout: each layer's weight and bias are flattened into ONE vector, padded with zeros to a
multiple of ``n`` (the number of devices); device ``i`` owns slice ``i`` of every such vector.
What a device keeps between steps are ``tf.Variable`` objects on that device, so the memory it
holds is counted exactly from them (``held_bytes``):

* ``weights``: the full vectors (stages 0-2) or the device's slices (stage 3);
* ``grads``: the gradient buffer, full (stages 0-1) or the device's slices (stages 2-3);
* ``optimizer``: Adam's ``m`` and ``v``, full (stage 0) or the device's slices (stages 1-3).

One step: every device runs forward and backward on its part of the batch; the gradients are
reduce-scattered (device ``i`` gets slice ``i`` of their sum); each device runs Adam on its slice;
the new slices are all-gathered (stages 0-2). Stage 0 all-gathers the summed gradient instead and
every device runs Adam on everything: a reduce-scatter + all-gather is an all-reduce with the
volume of a ring. Stage 3 keeps only the slices and gathers each layer's weights just before the
layer runs, forward and again backward (``accel.collectives.collective_op``), the gathered copy
never kept; the gradient of the gather is the reduce-scatter. Adam is Keras' form: ``alpha =
lr sqrt(1 - beta2^t) / (1 - beta1^t)``, ``w -= alpha m / (sqrt(v) + epsilon)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import (
    all_gather,
    check_devices,
    collective_op,
    on_device,
    reduce_scatter,
)
from accel.models import mlp_apply

__all__ = ["STAGES", "ZeroStep", "flatten_layers", "unflatten_layer", "adam_apply"]

STAGES = (0, 1, 2, 3)


def flatten_layers(params: Sequence, n: int) -> list[np.ndarray]:
    """``[w0, b0, w1, b1, ...]`` as one flat vector per layer, zero-padded to a multiple of
    ``n``."""
    n = checks.positive_int("n", n)
    if len(params) % 2 or not params:
        raise ValueError(f"params must alternate weight, bias; got {len(params)} arrays")
    out = []
    for w, b in zip(params[::2], params[1::2], strict=True):
        flat = np.concatenate([np.ravel(w), np.ravel(b)])
        out.append(np.pad(flat, (0, -len(flat) % n)))
    return out


def unflatten_layer(flat, w_shape: Sequence[int], b_shape: Sequence[int]) -> list:
    """The layer's ``[w, b]`` back from its flat (possibly padded) vector."""
    w_size = int(np.prod(w_shape))
    b_size = int(np.prod(b_shape))
    return [tf.reshape(flat[:w_size], w_shape), tf.reshape(flat[w_size:w_size + b_size], b_shape)]


def adam_apply(w, g, m: tf.Variable, v: tf.Variable, t, learning_rate: float,
               beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7):
    """One Adam update (Keras' form) at step ``t`` (1, 2, ...): updates the slots ``m`` and
    ``v`` in place and returns the new ``w`` (a tensor), where the caller's device scope is."""
    t = tf.cast(t, m.dtype)
    alpha = learning_rate * tf.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
    m.assign_add((g - m) * (1 - beta_1))
    v.assign_add((tf.square(g) - v) * (1 - beta_2))
    return w - alpha * m / (tf.sqrt(v) + epsilon)


class ZeroStep:
    """A ZeRO ``stage`` training step of ``mlp_apply`` with ``loss_fn`` (per-example) and Adam
    over ``devices``. ``step(xs, ys)`` takes one batch part per device (placed there) and returns
    the per-device losses; the loss is the mean over the whole batch."""

    def __init__(self, params: Sequence, devices: Sequence[str], stage: int, loss_fn,
                 learning_rate: float = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, dtype=tf.float32):
        if stage not in STAGES or isinstance(stage, bool):
            raise ValueError(f"stage must be one of {list(STAGES)} (0 = plain data "
                             f"parallelism), got {stage!r}")
        self.devices = check_devices(devices)
        self.n = n = len(self.devices)
        self.stage, self.loss_fn = stage, loss_fn
        self.lr = checks.positive_number("learning_rate", learning_rate)
        self.beta_1, self.beta_2 = beta_1, beta_2
        self.epsilon, self.dtype = epsilon, tf.as_dtype(dtype)
        flats = flatten_layers(params, n)
        self.shapes = [(np.shape(w), np.shape(b)) for w, b in zip(params[::2], params[1::2],
                                                                   strict=True)]
        self.params = sum(int(np.size(p)) for p in params)
        self.padded_params = sum(len(f) for f in flats)
        self.vars: dict[str, list[list[tf.Variable]]] = {k: [] for k in
                                                         ("weights", "grads", "optimizer")}
        self.iterations = []
        for i, d in enumerate(self.devices):
            with tf.device(d):
                mine = [np.split(f, n)[i] for f in flats]
                whole = flats if stage < 3 else mine
                self.vars["weights"].append([tf.Variable(f, dtype=self.dtype) for f in whole])
                g_like = flats if stage < 2 else mine
                self.vars["grads"].append([tf.Variable(tf.zeros(len(f), self.dtype))
                                           for f in g_like])
                o_like = flats if stage < 1 else mine
                self.vars["optimizer"].append(
                    [tf.Variable(tf.zeros(len(f), self.dtype)) for f in o_like for _ in (0, 1)])
                self.iterations.append(tf.Variable(0.0, dtype=self.dtype))
        self.step = tf.function(self._step)

    # -- what each device holds --------------------------------------------------------------
    def held_bytes(self) -> dict[str, dict[str, int]]:
        """Device -> bytes of its ``weights``, ``grads`` and ``optimizer`` variables, and their
        ``total`` (the step counter, one scalar, is left out)."""
        out = {}
        for i, d in enumerate(self.devices):
            row = {k: sum(v.shape.num_elements() * v.dtype.size for v in vs[i])
                   for k, vs in self.vars.items()}
            row["total"] = sum(row.values())
            out[d] = row
        return out

    def weights(self, device: int = 0) -> list[np.ndarray]:
        """The full weights ``[w0, b0, ...]`` as NumPy arrays (stage 3: the slices of all
        devices joined; otherwise device ``device``'s copy)."""
        out = []
        for layer, (ws, bs) in enumerate(self.shapes):
            if self.stage == 3:
                flat = np.concatenate([v[layer].numpy() for v in self.vars["weights"]])
            else:
                flat = self.vars["weights"][device][layer].numpy()
            out += [a.numpy() for a in unflatten_layer(flat, ws, bs)]
        return out

    # -- the step ------------------------------------------------------------------------------
    def _adam(self, i: int, w, g, m: tf.Variable, v: tf.Variable):
        """Adam on device ``i``: returns the new ``w`` (a tensor) after updating ``m``, ``v``."""
        return adam_apply(w, g, m, v, self.iterations[i], self.lr, self.beta_1, self.beta_2,
                          self.epsilon)

    def _local_loss(self, i: int, pred, y, batch):
        return on_device(lambda p, t: tf.reduce_sum(self.loss_fn(t, p)) / batch,
                         self.devices[i], pred, y)

    def _gathered_layer(self, layer: int, hs: list, slices: list, last: bool) -> list:
        """One layer of stage 3: its weights gathered from the slices (variables) just before
        use, forward and (again) backward; the weight gradient reduce-scattered back to the
        slices. The backward pass reads the slices anew: a graph sends a tensor to a device
        only once, so gathering the same read twice would ship nothing new (and would keep the
        first gathered copy alive until the backward pass)."""
        shards = [v.value() for v in slices]
        devs, (ws, bs) = self.devices, self.shapes[layer]

        def run(h, flat):
            w, b = unflatten_layer(flat, ws, bs)
            y = tf.matmul(h, w) + b
            return y if last else tf.nn.relu(y)

        def forward(xs):
            full = all_gather(xs[self.n:], devs)
            out = []
            for i, d in enumerate(devs):
                with tf.device(d):
                    out.append(run(xs[i], full[i]))
            return out

        def backward(dys):
            full = all_gather([v.value() for v in slices], devs)  # the forward copy was not kept
            dhs, dfull = [], []
            for i, d in enumerate(devs):
                with tf.device(d), tf.GradientTape() as tape:
                    tape.watch([hs[i], full[i]])
                    y = run(hs[i], full[i])
                    dh, dw = tape.gradient(y, [hs[i], full[i]], output_gradients=dys[i])
                dhs.append(dh)
                dfull.append(dw)
            return dhs + reduce_scatter(dfull, devs)

        return collective_op("GatheredLayer", list(hs) + list(shards), devs, forward, backward)

    def _gradients(self, xs, ys, batch) -> list[list]:
        """Per device, per layer: the gradient of the device's loss (stages 0-2, full vectors)
        or the device's slice of the summed gradient (stage 3)."""
        w = self.vars["weights"]
        if self.stage == 3:
            with tf.GradientTape() as tape:
                hs = list(xs)
                for layer in range(len(self.shapes)):
                    hs = self._gathered_layer(layer, hs, [w[i][layer] for i in range(self.n)],
                                              layer == len(self.shapes) - 1)
                losses = [self._local_loss(i, hs[i], ys[i], batch) for i in range(self.n)]
            sources = [v for vs in w for v in vs]
            ones = []
            for loss, d in zip(losses, self.devices, strict=True):
                with tf.device(d):
                    ones.append(tf.ones_like(loss))
            flat = tape.gradient(losses, sources, output_gradients=ones)
            k = len(self.shapes)
            return [flat[i * k:(i + 1) * k] for i in range(self.n)], losses
        grads, losses = [], []
        for i, d in enumerate(self.devices):
            with tf.device(d):
                with tf.GradientTape() as tape:
                    params = [a for layer, (ws, bs) in enumerate(self.shapes)
                              for a in unflatten_layer(w[i][layer], ws, bs)]
                    loss = tf.reduce_sum(self.loss_fn(ys[i], mlp_apply(params, xs[i]))) / batch
                grads.append(tape.gradient(loss, w[i]))
                losses.append(loss)
        return grads, losses

    def _step(self, xs, ys):
        batch = float(sum(int(x.shape[0]) for x in xs))  # static: no tensor crosses devices
        grads, losses = self._gradients(xs, ys, batch)
        for i, d in enumerate(self.devices):
            with tf.device(d):
                self.iterations[i].assign_add(1.0)
        for layer in range(len(self.shapes)):
            self._update_layer(layer, [g[layer] for g in grads])
        return losses

    def _update_layer(self, layer: int, grads: list) -> None:
        devs, n, stage = self.devices, self.n, self.stage
        gbuf = [self.vars["grads"][i][layer] for i in range(n)]
        wvar = [self.vars["weights"][i][layer] for i in range(n)]
        opt = [self.vars["optimizer"][i][2 * layer:2 * layer + 2] for i in range(n)]
        if stage == 3:  # the gradients came reduce-scattered from the backward pass
            for i in range(n):
                with tf.device(devs[i]):
                    gbuf[i].assign(grads[i])
                    wvar[i].assign(self._adam(i, wvar[i], gbuf[i], *opt[i]))
            return
        for i in range(n):
            if stage < 2:
                with tf.device(devs[i]):
                    gbuf[i].assign(grads[i])
        summed = reduce_scatter(grads, devs)
        if stage == 0:
            full = all_gather(summed, devs)
            for i in range(n):
                with tf.device(devs[i]):
                    wvar[i].assign(self._adam(i, wvar[i], full[i], *opt[i]))
            return
        new = []
        for i in range(n):
            with tf.device(devs[i]):
                if stage == 2:
                    gbuf[i].assign(summed[i])
                size = summed[i].shape[0]
                mine = wvar[i][i * size:(i + 1) * size]
                new.append(self._adam(i, mine, summed[i], *opt[i]))
        gathered = all_gather(new, devs)
        for i in range(n):
            with tf.device(devs[i]):
                wvar[i].assign(gathered[i])
