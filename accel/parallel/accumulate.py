"""Gradient accumulation: ``k`` micro-steps, each the forward and backward pass of ``1/k`` of the
batch adding its gradients into a buffer, then ONE optimizer update. The buffer ends equal to the
gradient of the whole batch's mean loss because each micro-batch's loss is its examples' sum
divided by the WHOLE batch's count (``accumulated_gradients``), so the step equals one step on
the ``k``-times larger batch, while only one micro-batch's activations are alive at a time (the
micro-steps run one after the other, eagerly). Averaging each micro-batch's own mean instead (as
Keras's ``gradient_accumulation_steps`` does, ``BaseOptimizer.apply``: ``(g + acc_g) / steps``)
gives the same only when every micro-batch counts the same number of examples or tokens; with
variable-length sequences it weights a token of a short micro-batch more (chapter 15).

``Accumulating(model, loss=..., optimizer=..., accumulation_steps=k)`` is the same for a Keras
model and a Keras optimizer on one device (``accel.parallel.replicas.KerasReplicas``, as
``accel.parallel.zero.Zero`` and ``accel.parallel.offload.Offload``, which take
``accumulation_steps`` too).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from accel import checks
from accel.parallel.replicas import KerasReplicas
from accel.training import make_update

__all__ = ["accumulated_gradients", "make_accumulating_step", "Accumulating"]


def accumulated_gradients(model: tf.keras.Model, loss_fn: Callable, x, y, k: int) -> list:
    """The gradients of ``mean(loss_fn(y, model(x)))`` over the whole batch, computed in ``k``
    micro-batches (the batch size must divide by ``k``) and summed into one buffer."""
    k = checks.positive_int("k", k)
    batch = int(x.shape[0])
    if batch % k:
        raise ValueError(f"batch size {batch} does not split into k={k} micro-batches")
    variables = model.trainable_variables
    buffer = [tf.zeros_like(v) for v in variables]
    for xm, ym in zip(tf.split(x, k), tf.split(y, k), strict=True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(ym, model(xm, training=True))) / batch
        buffer = [b + g for b, g in zip(buffer, tape.gradient(loss, variables), strict=True)]
    return buffer


def make_accumulating_step(model: tf.keras.Model, loss_fn: Callable, optimizer, k: int
                           ) -> Callable:
    """``step(x, y)``: ``accumulated_gradients`` then one update with ``optimizer`` (an optimizer
    or a learning rate, as ``accel.training.make_update``)."""
    k = checks.positive_int("k", k)
    update = make_update(optimizer, model.trainable_variables)

    def step(x, y):
        grads = accumulated_gradients(model, loss_fn, x, y, k)
        update(list(zip(grads, model.trainable_variables, strict=True)))

    return step


class Accumulating(KerasReplicas):
    """Gradient accumulation for a Keras model and a Keras optimizer on one ``device`` (default:
    the first GPU, else the first CPU): ``train_step(x, y)`` runs the batch in
    ``accumulation_steps`` micro-batches one after the other, adds their gradients into a buffer
    (each micro-batch's mean-loss gradient divided by ``accumulation_steps``) and makes ONE
    update. This is what Keras's optimizer option ``gradient_accumulation_steps=k`` does with
    ``fit`` on batches ``k`` times smaller: Keras adds the ``k`` gradients and divides by ``k``
    at the k-th batch, and its step count (``iterations``) moves once per update, so training
    on batch ``B`` here equals Keras's ``fit`` with batch ``B / k`` and
    ``gradient_accumulation_steps=k`` (BatchNorm included: each micro-batch is normalised on its
    own and updates the moving statistics in turn). An optimizer made with
    ``gradient_accumulation_steps=k`` gives ``k`` here too (``accumulation_steps`` may then be
    left out).

    The weights, the buffer and the optimizer's slots live on ``device``, in variables of this
    form; ``write_back()`` (and the end of ``fit``) puts them into the user's model. Optimizers:
    ``accel.parallel.form.keras_optimizer_factory``.
    """

    name = "accumulate"
    options = ("accumulation_steps", "exclude_from_weight_decay", "run_eagerly")

    def __init__(self, model, *, loss, optimizer, accumulation_steps: int | None = None,
                 device: str | None = None,
                 exclude_from_weight_decay=None, run_eagerly: bool = False):
        if accumulation_steps is None and not getattr(optimizer, "gradient_accumulation_steps",
                                                      None):
            raise ValueError("give accumulation_steps, or an optimizer made with Keras's "
                             "gradient_accumulation_steps")
        if device is None:
            device = (tf.config.list_logical_devices("GPU")
                      or tf.config.list_logical_devices("CPU"))[0].name
        super().__init__(model, [device], loss=loss, optimizer=optimizer,
                         accumulation_steps=accumulation_steps,
                         exclude_from_weight_decay=exclude_from_weight_decay,
                         run_eagerly=run_eagerly)
        self.device = self.devices[0]
        self._full = self._variables(self.device, self._weights)
        with tf.device(self.device):
            self._grads.append([tf.Variable(tf.zeros(w.shape, w.dtype), trainable=False)
                                for w in self._weights])
            self.optimizer = self._make_optimizer()
            self.optimizer.build(self._full)

    def held_variables(self) -> dict[str, dict[str, list]]:
        return {self.device: {"weights": self._full + self._state_vars[0],
                              "grads": self._grads[0],
                              "optimizer": self._slots(self.optimizer)}}

    def _trained_weights(self) -> list:
        return [v.numpy() for v in self._full]

    def _micro_step(self, xs, ys, scale) -> list:
        loss, grads = self._local_gradients(0, self._full, xs[0], ys[0], scale)
        with tf.device(self.device):
            for buffer, g in zip(self._grads[0], grads, strict=True):
                buffer.assign_add(g)
        return [loss]

    def _apply(self) -> None:
        with tf.device(self.device):
            grads = [g.read_value() for g in self._grads[0]]
            (grads,) = self._clip([grads], [self.device], sliced=False)
            self.optimizer.apply(grads, self._full)
