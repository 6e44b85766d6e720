"""The conventions every training loop of the course shares, written once.

* Losses are **per example**: ``loss_fn(y_true, y_pred)`` returns a ``[batch]`` tensor, and each
  loop takes its mean over the examples it owns (a worker's batch, a tower's shard, a
  micro-batch). ``squared_error`` is the course's regression loss.
* An update is given as a **learning rate** (plain SGD; any real number > 0, NumPy scalars
  included) or an **optimizer** (anything with ``apply_gradients``, e.g. a Keras optimizer).
  ``make_update`` checks it once, before any thread or device sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from accel import checks

__all__ = ["squared_error", "make_update"]


def squared_error(y_true, y_pred) -> tf.Tensor:
    """Per-example squared error (mean over the output axis): shape ``[batch]``."""
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


def make_update(optimizer, variables: Sequence, device: str | None = None,
                ) -> Callable[[list], None]:
    """A function applying ``[(gradient, variable), ...]`` (``None`` gradients are skipped).

    A learning rate gives plain SGD, one ``ResourceApplyGradientDescent`` per variable; an
    optimizer gives ``optimizer.apply_gradients``, its slots built next to the variables (under
    ``tf.device(device)``) if it was not built yet. Anything else is a ``ValueError`` here.
    """
    lr = checks.learning_rate(optimizer)
    if lr is not None:
        def sgd(pairs):
            for g, v in pairs:
                if g is not None:
                    tf.raw_ops.ResourceApplyGradientDescent(var=v.handle,
                                                            alpha=tf.cast(lr, v.dtype), delta=g)
        return sgd
    if not hasattr(optimizer, "apply_gradients"):
        raise ValueError(f"optimizer must be a learning rate (a number > 0) or have "
                         f"apply_gradients, got {type(optimizer).__name__}")
    if hasattr(optimizer, "build") and not getattr(optimizer, "built", True):
        with tf.device(device):
            optimizer.build(list(variables))
    compiled: dict[tuple[int, ...], Callable] = {}

    def apply(pairs):
        pairs = [(g, v) for g, v in pairs if g is not None]
        if tf.inside_function() or not pairs:  # a caller's graph compiles it already
            return optimizer.apply_gradients(pairs)
        # one compiled update per set of variables: an eager Keras update dispatches a dozen
        # small ops per variable from Python, several times the cost of a small model's step
        key = tuple(id(v) for _, v in pairs)
        if key not in compiled:
            held = [v for _, v in pairs]
            compiled[key] = tf.function(
                lambda grads: optimizer.apply_gradients(zip(grads, held, strict=True)),
                autograph=False)
        return compiled[key]([g for g, _ in pairs])
    return apply
