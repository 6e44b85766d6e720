"""Gradient accumulation: ``k`` micro-steps, each the forward and backward pass of ``1/k`` of the
batch adding its gradients into a buffer, then ONE optimizer update. With a loss that is a mean
over examples, the buffer ends equal to the gradient of the whole batch, so the step equals one
step on the ``k``-times larger batch, while only one micro-batch's activations are alive at a time
(the micro-steps run one after the other, eagerly).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from accel import checks
from accel.training import make_update

__all__ = ["accumulated_gradients", "make_accumulating_step"]


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
