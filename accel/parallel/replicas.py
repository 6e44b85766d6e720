"""``KerasReplicas``: a Keras model run by several devices, each on its shard of the batch
from weights it holds or gathers, through Keras's public ``StatelessScope``; the base of
``accel.parallel.zero.Zero``, ``accel.parallel.offload.Offload`` and
``accel.parallel.accumulate.Accumulating``, which differ in what each device keeps and how the
update is made."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import all_reduce
from accel.parallel import keras_model as km
from accel.parallel.form import Form, device_list, keras_optimizer_factory

__all__ = ["KerasReplicas"]


def _accumulation_steps(optimizer, steps: int | None) -> int:
    """The form's ``accumulation_steps``, or Keras's own ``gradient_accumulation_steps`` of the
    optimizer, which means the same (``ValueError`` if both are given and differ)."""
    keras_steps = None if isinstance(optimizer, str) else getattr(
        optimizer, "gradient_accumulation_steps", None)
    if steps is None:
        return checks.positive_int("gradient_accumulation_steps", keras_steps or 1)
    checks.positive_int("accumulation_steps", steps)
    if keras_steps and steps != keras_steps:
        raise ValueError(f"accumulation_steps={steps} but the optimizer's "
                         f"gradient_accumulation_steps={keras_steps}: give one of them")
    return steps


def _nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def _unique(variables) -> list:
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _takes_training(layer) -> bool:
    params = inspect.signature(layer.call).parameters
    return "training" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class KerasReplicas(Form):
    """What ``Zero``, ``accel.parallel.offload.Offload`` and
    ``accel.parallel.accumulate.Accumulating`` share: a Keras model run on several devices,
    each device running it on its shard of the batch from weights it holds or gathers, with
    Keras's public ``layer.stateless_call`` (layer after layer of a ``Sequential``, or the whole
    model), so no working copy of the model is built.

    * The batch splits into one shard per device (in order), each shard into
      ``accumulation_steps`` micro-batches run one after the other, their gradients added into
      a buffer (``grads``), then ONE update: the step equals one step on the whole batch for a
      loss that is a mean over examples (and layers that do not mix examples).
    * BatchNormalization: each device normalises its own micro-batch and keeps its own moving
      statistics, updated from its micro-batches in order; ``write_back`` writes the first
      device's (``devices[0]``: the statistics of the first shard). So the one-device reference
      is the loss averaged over the micro-batches each run separately.
    * ``train_step``, ``fit`` (Keras's habits; batches a multiple of ``len(devices) *
      accumulation_steps``) and ``write_back``: ``accel.parallel.form.Form``'s;
      ``held_variables()`` and ``held_bytes()``: what each device keeps between steps.
    * Training loss: the compiled loss plus the terms the model adds (``model.losses``),
      each device and micro-batch its share, as ``fit`` under a strategy. Gradients go through
      flat buffers, so an ``Embedding``'s sparse gradient is made dense: the optimizer updates
      as Keras's fed that dense gradient (for Adam not ``fit``'s sparse update when a token
      repeats in a batch).
    * ``mixed_float16`` with Keras's ``LossScaleOptimizer``: the loss is scaled by its current
      scale before the backward, as ``fit`` does; every device's optimizer is such a wrapper,
      and the devices reach ONE verdict on the step's gradients (a device that holds a slice
      cannot see the others' infinities): the finiteness of all of them, all-reduced, so every
      device applies the step or every device skips it and halves its scale. Its scale grows
      after ``dynamic_growth_steps`` finite updates (Keras's counts each micro-batch's apply
      when it accumulates). ``mixed_bfloat16`` needs no scaling.
    * ``run_eagerly=True``: the step runs op by op (no tracing: cheaper for a few steps of
      a model whose tracing is slow, such as attention); else one ``tf.function``.
    """

    def __init__(self, model, devices: Sequence[str], *, loss, optimizer,
                 accumulation_steps: int | None = None,
                 exclude_from_weight_decay: Sequence[str] | None = None,
                 run_eagerly: bool = False):
        self.devices = device_list(devices)
        self.n = len(self.devices)
        self.accumulation_steps = _accumulation_steps(optimizer, accumulation_steps)
        if not isinstance(model, keras.Model) or not model.built or not model.trainable_variables:
            raise ValueError("model must be a built keras.Model with trainable weights: start "
                             "it with keras.Input(shape) or call it once on a batch")
        self.model = model
        self.loss_fn = km.loss_function(loss)
        make, self.global_clipnorm = keras_optimizer_factory(
            optimizer, exclude_from_weight_decay, accepts_accumulation=True)
        self._made: list = []  # every optimizer made: each device's (or the host's)

        def make_optimizer():
            self._made.append(make())
            return self._made[-1]

        self._make_optimizer = make_optimizer
        self.units = km.sequential_layers(model) if isinstance(model, keras.Sequential) \
            else [model]
        self._weights = _unique(v for u in self.units for v in u.trainable_variables)
        self._states = _unique(v for u in self.units for v in u.non_trainable_variables)
        where = {id(v): j for j, v in enumerate(self._weights)}
        self._tidx = [[where[id(v)] for v in u.trainable_variables] for u in self.units]
        where = {id(v): j for j, v in enumerate(self._states)}
        self._nidx = [[where[id(v)] for v in u.non_trainable_variables] for u in self.units]
        self._training = [_takes_training(u) for u in self.units]
        self._state_vars = [self._variables(d, self._states) for d in self.devices]
        self._grads: list[list[tf.Variable]] = []
        self._run_step = self._run if run_eagerly else tf.function(self._run, autograph=False)

    # -- variables -------------------------------------------------------------------------
    @staticmethod
    def _variables(device: str, like, values=None) -> list[tf.Variable]:
        """New variables on ``device`` named as ``like`` (Keras variables), holding ``values``
        (default: ``like``'s values)."""
        values = [v.numpy() for v in like] if values is None else values
        with tf.device(device):
            return [tf.Variable(a, name=v.name, trainable=v.trainable)
                    for v, a in zip(like, values, strict=True)]

    def held_variables(self) -> dict[str, dict[str, list]]:
        """Device -> ``{"weights", "grads", "optimizer"}`` -> the variables it keeps between
        steps (the optimizer's scalars, its step count and learning rate, left out)."""
        raise NotImplementedError

    def held_bytes(self) -> dict[str, dict[str, int]]:
        """Device -> bytes of its ``weights``, ``grads`` and ``optimizer`` variables
        (``held_variables``) and their ``total``."""
        out = {}
        for d, groups in self.held_variables().items():
            row = {k: _nbytes(vs) for k, vs in groups.items()}
            row["total"] = sum(row.values())
            out[d] = row
        return out

    def working_variables(self) -> list:
        return [v for groups in self.held_variables().values() for v in groups["weights"]]

    def optimizer_variables(self) -> list:
        return [v for groups in self.held_variables().values() for v in groups["optimizer"]]

    @staticmethod
    def _slots(optimizer) -> list:
        return [v for v in optimizer.variables if len(v.shape)]

    # -- training ----------------------------------------------------------------------------
    def _step(self, x, y):
        parts = self.batch_parts()
        if int(x.shape[0]) % parts or int(y.shape[0]) != int(x.shape[0]):
            raise ValueError(f"a batch of {int(x.shape[0])} examples ({int(y.shape[0])} labels) "
                             f"does not split into {self.n} devices x {self.accumulation_steps} "
                             f"micro-batches: give a batch size that is a multiple of {parts}")
        return self._run_step(tuple(tf.split(x, parts)), tuple(tf.split(y, parts)))

    def batch_parts(self) -> int:
        return self.n * self.accumulation_steps

    def write_back(self) -> None:
        """The trained weights into the user's model: the full trainable weights, and the
        non-trainable ones (BatchNorm's moving statistics) of ``devices[0]``."""
        for v, value in zip(self._weights, self._trained_weights(), strict=True):
            v.assign(value)
        for v, s in zip(self._states, self._state_vars[0], strict=True):
            v.assign(s.numpy())

    def _trained_weights(self) -> list[np.ndarray]:
        raise NotImplementedError

    def _loss_scale(self):
        """A ``LossScaleOptimizer``'s current scale (every device's is the same), or ``None``."""
        return km.loss_scale(self._made[0])

    def _run(self, xs, ys):
        k, n = self.accumulation_steps, self.n
        for gs, d in zip(self._grads, self.devices, strict=True):
            with tf.device(d):
                for g in gs:
                    g.assign(tf.zeros_like(g))
        losses, scale = [], self._loss_scale()
        share = 1.0 / (n * k) if scale is None else scale / (n * k)
        for j in range(k):
            losses += self._micro_step([xs[i * k + j] for i in range(n)],
                                       [ys[i * k + j] for i in range(n)], share)
        self._apply()
        with tf.device(self.devices[0]):
            loss = tf.add_n(losses)
            return loss if scale is None else loss / tf.cast(scale, loss.dtype)

    def _micro_step(self, xs, ys, scale) -> list:
        raise NotImplementedError

    def _apply(self) -> None:
        raise NotImplementedError

    # -- the model, layer after layer ----------------------------------------------------------
    def _run_unit(self, u: int, h, values, states):
        """``(output, new states, added losses)`` of unit ``u`` on ``h`` with its weights and
        states taken from ``values`` and ``states``. What ``layer.stateless_call`` does, but
        through ``layer.__call__``: Keras casts the inputs and (``dtype_policy`` mixed) the
        weights to the compute dtype only there, so a mixed-precision model computes in
        float16 / bfloat16 as under ``fit`` (``stateless_call`` runs ``call`` in float32)."""
        unit = self.units[u]
        kwargs = {"training": True} if self._training[u] else {}
        mapping = list(zip(unit.trainable_variables, values, strict=True)) + list(
            zip(unit.non_trainable_variables, states, strict=True))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            out = unit(h, **kwargs)
            losses = list(unit.losses)
        new = [scope.get_current_value(v) for v in unit.non_trainable_variables]
        return out, new, losses

    def _forward(self, x, values, states):
        """``(prediction, new states, added losses)`` of the model on ``x`` with the full
        weights ``values`` and the states ``states`` (lists aligned with the model's)."""
        states, extra = list(states), []
        for u in range(len(self.units)):
            x, new, losses = self._run_unit(u, x, [values[j] for j in self._tidx[u]],
                                            [states[j] for j in self._nidx[u]])
            for j, s in zip(self._nidx[u], new, strict=True):
                states[j] = s
            extra += losses
        return x, states, extra

    def _loss(self, y, pred, extra, scale):
        loss = km.training_loss(self.loss_fn, y, pred, extra)
        return loss * tf.cast(scale, loss.dtype)

    def _local_gradients(self, i: int, weights, x, y, scale):
        """Device ``i``'s scaled loss on ``(x, y)`` and its gradients for ``weights`` (the
        device's full weight variables); its states updated."""
        with tf.device(self.devices[i]):
            with tf.GradientTape() as tape:
                pred, states, extra = self._forward(
                    x, [w.read_value() for w in weights],
                    [s.read_value() for s in self._state_vars[i]])
                loss = self._loss(y, pred, extra, scale)
            grads = tape.gradient(loss, weights,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            for v, s in zip(self._state_vars[i], states, strict=True):
                v.assign(s)
        return loss, grads

    def _clip(self, grads: list, devices: list[str], sliced: bool) -> list:
        """Per device, the gradients its optimizer applies: under loss scaling, NaN on every
        device unless all devices' gradients are finite (one verdict, all-reduced when each
        holds a slice); then scaled as Keras's ``global_clipnorm`` does (the squared norm
        all-reduced likewise, of the unscaled gradients)."""
        loss_scale = self._loss_scale()
        if loss_scale is not None:
            grads = self._one_verdict(grads, devices, sliced)
        if not self.global_clipnorm:
            return grads
        clip = float(self.global_clipnorm)
        squares = []
        for gs, d in zip(grads, devices, strict=True):
            with tf.device(d):
                squares.append(tf.add_n([tf.reduce_sum(tf.square(g)) for g in gs]))
        if sliced and len(devices) > 1:
            squares = all_reduce(squares, devices)
        out = []
        for gs, s, d in zip(grads, squares, devices, strict=True):
            with tf.device(d):
                norm = tf.sqrt(s) if loss_scale is None else \
                    tf.sqrt(s) / tf.cast(loss_scale, s.dtype)
                scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
                out.append([g * scale for g in gs])
        return out

    @staticmethod
    def _one_verdict(grads: list, devices: list[str], sliced: bool) -> list:
        """``grads`` (per device) unchanged where every device's are finite, else all NaN, so
        that each device's ``LossScaleOptimizer`` judges the whole step as one would."""
        finite = []
        for gs, d in zip(grads, devices, strict=True):
            with tf.device(d):
                ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in gs])
                finite.append(tf.cast(ok, tf.float32))
        if sliced and len(devices) > 1:
            finite = all_reduce(finite, devices)
        out = []
        for gs, f, d in zip(grads, finite, devices, strict=True):
            with tf.device(d):
                ok = tf.equal(f, float(len(devices)) if sliced and len(devices) > 1 else 1.0)
                out.append([g * tf.where(ok, tf.ones((), g.dtype), tf.constant(np.nan, g.dtype))
                            for g in gs])
        return out
