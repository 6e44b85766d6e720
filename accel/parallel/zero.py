"""ZeRO stages 0-3 written by hand: data parallelism with Adam whose optimizer state (stage 1),
gradients (stage 2) and weights (stage 3) are sharded over the devices (Rajbhandari et al. 2019,
arXiv:1910.02054). Stage 0 is plain data parallelism, the baseline.

The model is a stack of layers, each a function of its ``[weight, bias]`` and its input
(``layer_fns``), so that stage 3 can run it one layer at a time.

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

``Zero(model, devices, loss=..., optimizer=..., stage=...)`` is the same idea for a Keras model
and a Keras optimizer (one sharded optimizer per device, each variable flattened and padded on
its own); ``accel.parallel.form.keras_optimizer_factory`` says which optimizers it takes and
why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import (
    all_gather,
    all_reduce,
    check_devices,
    collective_op,
    on_device,
    reduce_scatter,
)
from accel.parallel import keras_model as km
from accel.parallel.replicas import KerasReplicas

__all__ = ["STAGES", "ZeroStep", "flatten_layers", "unflatten_layer", "adam_apply", "Zero"]

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
    """A ZeRO ``stage`` training step, with ``loss_fn`` (per-example) and Adam over ``devices``,
    of the model whose layers are ``layer_fns``: layer ``k`` is ``layer_fns[k]([w_k, b_k], h)``
    with ``params = [w0, b0, w1, b1, ...]`` (``accel.parallel.layers.dense`` / ``linear``, say);
    the layers run one after the other (stage 3 gathers each layer's weights just before it
    runs). ``step(xs, ys)`` takes one batch part per device (placed there) and returns the
    per-device losses; the loss is the mean over the whole batch."""

    def __init__(self, params: Sequence, devices: Sequence[str], stage: int, loss_fn,
                 learning_rate: float = 1e-3, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, dtype=tf.float32, *, layer_fns: Sequence[Callable],
                 prefetch: int | None = None):
        if stage not in STAGES or isinstance(stage, bool):
            raise ValueError(f"stage must be one of {list(STAGES)} (0 = plain data "
                             f"parallelism), got {stage!r}")
        if prefetch is not None:
            if stage != 3:
                raise ValueError(f"prefetch orders stage 3's gathers; stage {stage} gathers no "
                                 "layer: leave prefetch=None")
            prefetch = checks.non_negative_int("prefetch", prefetch)
        self.prefetch = prefetch
        self._done_forward: dict[int, list] = {}
        self._done_backward: dict[int, list] = {}
        self.devices = check_devices(devices)
        self.n = n = len(self.devices)
        self.stage, self.loss_fn = stage, loss_fn
        self.lr = checks.positive_number("learning_rate", learning_rate)
        self.beta_1, self.beta_2 = beta_1, beta_2
        self.epsilon, self.dtype = epsilon, tf.as_dtype(dtype)
        flats = flatten_layers(params, n)
        self.layer_fns = [] if callable(layer_fns) else list(layer_fns)
        if len(self.layer_fns) != len(flats) or not all(map(callable, self.layer_fns)):
            raise ValueError(f"layer_fns must be one function per layer (weight, bias pair), "
                             f"{len(flats)} here, got {layer_fns!r}")
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
        self.step = tf.function(self._step, autograph=False)

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

    def _gathered_layer(self, layer: int, hs: list, slices: list) -> list:
        """One layer of stage 3: its weights gathered from the slices (variables) just before
        use, forward and (again) backward; the weight gradient reduce-scattered back to the
        slices. The backward pass reads the slices anew: a graph sends a tensor to a device
        only once, so gathering the same read twice would ship nothing new (and would keep the
        first gathered copy alive until the backward pass). The backward re-runs the layer on
        its saved input (what it computed inside is not kept). With ``prefetch`` set, each
        gather waits for the layer ``prefetch + 1`` places before it in the run order
        (``_waiting``); the ops are named ``fwd_gather_<layer>``, ``fwd_layer_<layer>``,
        ``bwd_gather_<layer>``, ``bwd_layer_<layer>``, ``bwd_scatter_<layer>``."""
        shards = [v.value() for v in slices]
        devs, (ws, bs), n = self.devices, self.shapes[layer], self.n

        def run(h, flat):
            return self.layer_fns[layer](unflatten_layer(flat, ws, bs), h)

        def forward(xs):
            with tf.name_scope(f"fwd_gather_{layer}"):
                full = all_gather(self._waiting(xs[n:], self._forward_wait(layer)), devs)
            out = []
            with tf.name_scope(f"fwd_layer_{layer}"):
                for i, d in enumerate(devs):
                    with tf.device(d):
                        out.append(run(xs[i], full[i]))
            self._done_forward[layer] = out
            return out

        def backward(dys):
            with tf.name_scope(f"bwd_gather_{layer}"):  # the forward copy was not kept
                reads = [v.value() for v in slices]
                full = all_gather(self._waiting(reads, self._backward_wait(layer)), devs)
            dhs, dfull = [], []
            with tf.name_scope(f"bwd_layer_{layer}"):  # its gradient ops: gradient_tape/bwd_...
                for i, d in enumerate(devs):
                    with tf.device(d):
                        with tf.GradientTape() as tape:
                            tape.watch([hs[i], full[i]])
                            y = run(hs[i], full[i])
                        dh, dw = tape.gradient(y, [hs[i], full[i]], output_gradients=dys[i])
                    dhs.append(dh)
                    dfull.append(dw)
            self._done_backward[layer] = dhs
            with tf.name_scope(f"bwd_scatter_{layer}"):
                return dhs + reduce_scatter(dfull, devs)

        return collective_op("GatheredLayer", list(hs) + list(shards), devs, forward, backward)

    # -- stage 3's gather order (prefetch) -------------------------------------------------
    def _forward_wait(self, layer: int) -> list | None:
        """What the forward gather of ``layer`` waits for: the outputs of layer
        ``layer - 1 - prefetch`` (none for the first layers, or without ``prefetch``)."""
        if self.prefetch is None:
            return None
        return self._done_forward.get(layer - 1 - self.prefetch)

    def _backward_wait(self, layer: int) -> list | None:
        """What the backward gather of ``layer`` waits for: the backward of layer
        ``layer + 1 + prefetch`` (its input gradients), or the end of the forward pass for the
        last layers (the backward runs them first)."""
        if self.prefetch is None:
            return None
        later = layer + 1 + self.prefetch
        if later < len(self.shapes):
            return self._done_backward.get(later)
        return self._done_forward.get(len(self.shapes) - 1)

    def _waiting(self, shards: list, wait: list | None) -> list:
        """``shards`` passed on by an identity on each device that runs only after that
        device's ``wait`` tensor exists (a control dependency; an identity copies nothing), so
        the gather they feed cannot start earlier. Without ``wait``, TensorFlow's executor runs
        a gather as soon as its slices are read: for every layer at the start of the step."""
        if wait is None:
            return list(shards)
        out = []
        for s, w, d in zip(shards, wait, self.devices, strict=True):
            with tf.device(d), tf.control_dependencies([w]):
                out.append(tf.identity(s))
        return out

    def _gradients(self, xs, ys, batch) -> list[list]:
        """Per device, per layer: the gradient of the device's loss (stages 0-2, full vectors)
        or the device's slice of the summed gradient (stage 3)."""
        w = self.vars["weights"]
        if self.stage == 3:
            self._done_forward, self._done_backward = {}, {}  # this trace's layers, for prefetch
            with tf.GradientTape() as tape:
                hs = list(xs)
                for layer in range(len(self.shapes)):
                    hs = self._gathered_layer(layer, hs, [w[i][layer] for i in range(self.n)])
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
                    h = xs[i]
                    for layer, (fn, (ws, bs)) in enumerate(zip(self.layer_fns, self.shapes,
                                                               strict=True)):
                        h = fn(unflatten_layer(w[i][layer], ws, bs), h)
                    loss = tf.reduce_sum(self.loss_fn(ys[i], h)) / batch
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


# -- the same for a Keras model and a Keras optimizer ----------------------------------------

def _padded(t, n: int):
    """``t`` flattened and zero-padded to a multiple of ``n``."""
    flat = tf.reshape(t, [-1])
    return tf.pad(flat, [[0, -int(flat.shape[0]) % n]])


class Zero(KerasReplicas):
    """ZeRO (Rajbhandari et al. 2019) for a Keras model and a Keras optimizer: data parallelism
    over ``devices`` whose optimizer state (``stage=1``), also gradients (``2``) and also
    weights (``3``) are sharded; ``stage=0`` is plain data parallelism (the baseline).

    Each trainable variable is flattened and zero-padded to a multiple of ``n = len(devices)``;
    device ``i`` owns slice ``i`` of each. Per device, one Keras optimizer
    (``keras_optimizer_factory``: SGD, Adam, AdamW, RMSprop, Adagrad) built eagerly on that
    device's slices, so its slots sit on the device. What each device keeps
    (``held_variables``, ``held_bytes``):

    * ``weights``: full copies of the weights (stages 0-2) or its slices (stage 3), plus the
      non-trainable state (BatchNorm's moving statistics), full on every device;
    * ``grads``: the gradient buffer, full (stages 0-1) or its slice (stages 2-3);
    * ``optimizer``: the slots, full (stage 0) or of its slices (1-3), and in stages 1-2 the
      master slice the optimizer updates (ZeRO counts the master weights as optimizer state).

    One step: every device runs ``accumulation_steps`` micro-batches of its shard. Stages 0-1
    add the full gradients into the buffer; at the end stage 0 all-reduces it and stage 1
    reduce-scatters it (each device gets the sum of its slice: one exchange per step, whatever
    the number of micro-batches); stage 2 keeps only its slice, so it reduce-scatters each
    micro-batch's gradients into it (one exchange per micro-batch, as DeepSpeed's ZeRO 2
    does: ``accel.costmodel.zero.zero_comm_bytes_accumulated``); stage 3
    gathers each layer's weights from the slices just before the layer runs
    (``accel.collectives.all_gather``), forward and again backward, the gathered copy never
    kept, the gradient reduce-scattered back (``collective_op``). Each device updates its
    slices; stages 1-2 all-gather the new slices into the full copies. ``write_back()`` (and the
    end of ``fit``) puts the full weights and ``devices[0]``'s BatchNorm statistics into the
    user's model (``KerasReplicas``). Stage 3 gathers layer by layer for a ``Sequential`` (the
    whole model at once for other models); the terms a layer adds to the loss (regularizers of
    its gathered weights, ``add_loss``) are outputs of that layer's gathered op, so their
    gradients reach the slices as the layer's do. The gathers are not ordered: TensorFlow's
    executor may run several layers' gathers at once (``ZeroStep``'s ``prefetch`` shows how
    control dependencies bound them).
    """

    name = "zero"
    options = ("stage", "accumulation_steps", "exclude_from_weight_decay", "run_eagerly")

    def __init__(self, model, devices: Sequence[str], *, loss, optimizer, stage: int = 1,
                 accumulation_steps: int | None = None,
                 exclude_from_weight_decay: Sequence[str] | None = None,
                 run_eagerly: bool = False):
        if stage not in STAGES or isinstance(stage, bool):
            raise ValueError(f"stage must be one of {list(STAGES)} (0 = plain data "
                             f"parallelism, 1 = optimizer state sharded, 2 = also gradients, "
                             f"3 = also weights), got {stage!r}")
        super().__init__(model, devices, loss=loss, optimizer=optimizer,
                         accumulation_steps=accumulation_steps,
                         exclude_from_weight_decay=exclude_from_weight_decay,
                         run_eagerly=run_eagerly)
        self.stage, n = stage, self.n
        self.sizes = [int(np.prod(w.shape)) for w in self._weights]
        flats = [_padded(w.value, n).numpy() for w in self._weights]
        self._full, self._slices, self.optimizers = [], [], []
        for i, d in enumerate(self.devices):
            if stage < 3:
                self._full.append(self._variables(d, self._weights))
            if stage > 0:
                self._slices.append(self._variables(d, self._weights,
                                                    [np.split(f, n)[i] for f in flats]))
            length = [len(f) // n if stage >= 2 else len(f) for f in flats]
            with tf.device(d):
                self._grads.append([tf.Variable(tf.zeros(m, w.dtype), trainable=False)
                                    for m, w in zip(length, self._weights, strict=True)])
                opt = self._make_optimizer()
                opt.build(self._full[i] if stage == 0 else self._slices[i])
            self.optimizers.append(opt)

    def held_variables(self) -> dict[str, dict[str, list]]:
        out = {}
        for i, d in enumerate(self.devices):
            weights = self._full[i] if self.stage < 3 else self._slices[i]
            master = self._slices[i] if self.stage in (1, 2) else []
            out[d] = {"weights": weights + self._state_vars[i], "grads": self._grads[i],
                      "optimizer": self._slots(self.optimizers[i]) + master}
        return out

    def _trained_weights(self) -> list[np.ndarray]:
        if self.stage < 3:
            return [v.numpy() for v in self._full[0]]
        return [np.concatenate([s[j].numpy() for s in self._slices])[:size].reshape(w.shape)
                for j, (w, size) in enumerate(zip(self._weights, self.sizes, strict=True))]

    def _unflat(self, flat, j: int):
        return tf.reshape(flat[:self.sizes[j]], self._weights[j].shape)

    # -- the step ----------------------------------------------------------------------------
    def _micro_step(self, xs, ys, scale) -> list:
        if self.stage == 3:
            return self._gathered_micro_step(xs, ys, scale)
        losses, flats = [], []
        for i, d in enumerate(self.devices):
            loss, grads = self._local_gradients(i, self._full[i], xs[i], ys[i], scale)
            losses.append(loss)
            with tf.device(d):
                flats.append([_padded(g, self.n) for g in grads])
        for j in range(len(self._weights)):
            parts = [f[j] for f in flats]
            if self.stage == 2:
                parts = reduce_scatter(parts, self.devices)
            for i, d in enumerate(self.devices):
                with tf.device(d):
                    self._grads[i][j].assign_add(parts[i])
        return losses

    def _apply(self) -> None:
        devs, n, stage = self.devices, self.n, self.stage
        count = len(self._weights)
        buffers = self._read_on_devices(self._grads)  # read where they live: no copy
        if stage == 0:
            summed = [all_reduce([b[j] for b in buffers], devs) for j in range(count)]
            grads = []
            for i, d in enumerate(devs):
                with tf.device(d):
                    grads.append([self._unflat(summed[j][i], j) for j in range(count)])
        elif stage == 1:  # the whole buffer accumulated locally, reduce-scattered once
            parts = [reduce_scatter([b[j] for b in buffers], devs) for j in range(count)]
            grads = [[parts[j][i] for j in range(count)] for i in range(n)]
        else:
            grads = buffers
        grads = self._clip(grads, devs, sliced=stage > 0)
        for i, d in enumerate(devs):
            with tf.device(d):
                self.optimizers[i].apply(grads[i], self._full[i] if stage == 0
                                         else self._slices[i])
        if stage in (1, 2):
            slices = self._read_on_devices(self._slices)
            for j in range(count):
                full = all_gather([s[j] for s in slices], devs)
                for i, d in enumerate(devs):
                    with tf.device(d):
                        self._full[i][j].assign(self._unflat(full[i], j))

    def _read_on_devices(self, variables: list[list]) -> list[list]:
        """Per device, its variables' values read on that device (``read_value`` outside a
        device scope would read them on the default device: a copy there and back)."""
        out = []
        for vs, d in zip(variables, self.devices, strict=True):
            with tf.device(d):
                out.append([v.read_value() for v in vs])
        return out

    def _gathered_micro_step(self, xs, ys, scale) -> list:
        """Stage 3: the forward and backward with each layer's weights gathered from the
        slices; the slices' gradients (reduce-scattered) added into the buffers."""
        devs = self.devices
        states = self._read_on_devices(self._state_vars)
        with tf.GradientTape() as tape:
            hs, added = list(xs), [[] for _ in devs]
            for u in range(len(self.units)):
                hs, extra = self._gathered_unit(u, hs, states)
                for i, e in enumerate(extra):
                    added[i].append(e)
            losses = [on_device(lambda p, t, *e: self._loss(t, p, e, scale), d, h, y, *a)
                      for d, h, y, a in zip(devs, hs, ys, added, strict=True)]
        sources = [v for vs in self._slices for v in vs]
        ones = []
        for loss, d in zip(losses, devs, strict=True):
            with tf.device(d):
                ones.append(tf.ones_like(loss))
        grads = tape.gradient(losses, sources, output_gradients=ones,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        count = len(self._weights)
        for i, d in enumerate(devs):
            with tf.device(d):
                for j in range(count):
                    self._grads[i][j].assign_add(grads[i * count + j])
                for v, s in zip(self._state_vars[i], states[i], strict=True):
                    v.assign(s)
        return losses

    def _gathered_unit(self, u: int, hs: list, states: list) -> tuple[list, list]:
        """``(outputs, added)`` per device: one layer (unit) of stage 3 on every device,
        recorded as one op: forward, its weights all-gathered from the slices and the layer run
        with them; backward, gathered again (the forward copy was not kept), the layer re-run
        under a tape and the weight gradients reduce-scattered to the slices. ``added[i]``:
        the terms the layer added to device ``i``'s loss; ``states[i]`` gets the new states."""
        devs, n = self.devices, self.n
        idx, nidx, m = self._tidx[u], self._nidx[u], len(self._tidx[u])
        used = [[states[i][j] for j in nidx] for i in range(n)]

        def reads():
            return [self._slices[i][j].value() for i in range(n) for j in idx]

        def gather(shards):
            per_var = [all_gather([shards[i * m + a] for i in range(n)], devs)
                       for a in range(m)]
            return [[per_var[a][i] for a in range(m)] for i in range(n)]

        def run(i, h, full):
            # the layer's added loss terms (regularizers of the gathered weights, add_loss)
            # are one more output per device, so their gradient reaches the slices too
            y, new, extra = self._run_unit(u, h, [self._unflat(f, j) for f, j in
                                                  zip(full, idx, strict=True)], used[i])
            added = km.added_loss(extra)
            return y, new, tf.zeros((), keras.config.floatx()) if added is None else added

        def forward(ts):
            full, out, extras = gather(ts[n:]), [], []
            for i, d in enumerate(devs):
                with tf.device(d):
                    y, new, extra = run(i, ts[i], full[i])
                for j, s in zip(nidx, new, strict=True):
                    states[i][j] = s
                out.append(y)
                extras.append(extra)
            return out + extras

        def backward(dys):
            full, dhs, dws = gather(reads()), [], []
            for i, d in enumerate(devs):
                with tf.device(d):
                    with tf.GradientTape() as tape:
                        tape.watch([hs[i], *full[i]])
                        y, _, extra = run(i, hs[i], full[i])
                    g = tape.gradient([y, extra], [hs[i], *full[i]],
                                      output_gradients=[dys[i], dys[n + i]],
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                dhs.append(g[0])
                dws.append(g[1:])
            parts = [reduce_scatter([dws[i][a] for i in range(n)], devs) for a in range(m)]
            return dhs + [parts[a][i] for i in range(n) for a in range(m)]

        outputs = collective_op(f"ZeroStage3Layer{u}", list(hs) + reads(), devs + devs,
                                forward, backward)
        return outputs[:n], outputs[n:]
