"""The same training as the towers recipe, with ``tf.distribute.MirroredStrategy``.

* ``mirrored_strategy(devices)``: a strategy over exactly those devices, whose gradient sum runs
  on the first device (like the towers) so that strategies of several sizes share a process;
* ``make_mirrored_step(strategy, model, loss_fn, optimizer, global_batch_size)``: a custom-loop
  training step, the loss scaled by the *global* batch size;
* ``Mirrored(build, devices)``: your Keras model under the strategy: ``build()`` creates and
  compiles it inside ``strategy.scope()`` (Keras needs the model and its optimizer made there),
  then Keras's own ``fit`` runs it on every device.

The hand-written version of the same step is ``accel.parallel.data.make_tower_step``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from accel import checks
from accel.devices import parse_device

__all__ = ["mirrored_strategy", "make_mirrored_step", "Mirrored"]


def mirrored_strategy(devices: Sequence[str],
                      cross_device_ops: tf.distribute.CrossDeviceOps | None | str = "auto",
                      ) -> tf.distribute.MirroredStrategy:
    """``MirroredStrategy`` over exactly ``devices`` (a subset of the logical devices).

    ``cross_device_ops="auto"``: ``ReductionToOneDevice(devices[0])``: gradients summed on the
    first device and the result sent back, like the towers recipe. ``None``: TensorFlow's
    default (collective all-reduce; NCCL on GPUs), the fast choice on real multi-GPU machines.
    Why not the default here: in TF 2.21 two strategies with different numbers of replicas in one
    process reuse a collective group key and the second aborts ("is joining a group with size 4,
    but that group has size 2"), and the chapter builds strategies over 1, 2 and 4 devices.
    """
    names = [parse_device(d).to_string() for d in devices]
    if not names:
        raise ValueError("devices is empty: give at least one device name")
    if cross_device_ops == "auto":
        cross_device_ops = tf.distribute.ReductionToOneDevice(names[0])
    elif isinstance(cross_device_ops, str):
        raise ValueError(f"cross_device_ops must be 'auto', None or a CrossDeviceOps, "
                         f"got {cross_device_ops!r}")
    return tf.distribute.MirroredStrategy(devices=names, cross_device_ops=cross_device_ops)


def make_mirrored_step(strategy: tf.distribute.Strategy, model: tf.keras.Model,
                       loss_fn: Callable, optimizer, global_batch_size: int, l2: float = 0.0):
    """A custom-loop training step under ``strategy`` for a Keras ``model`` built in its scope.

    Each replica scales its per-example losses by the *global* batch size
    (``tf.nn.compute_average_loss``); the optimizer sums the replicas' gradients (an all-reduce),
    so the update equals the single-device step on the whole batch. ``l2`` adds
    ``l2 * sum(kernel**2)`` over the kernels (weights of rank >= 2), divided among the replicas
    (``tf.nn.scale_regularization_loss``). ``step(batch)`` takes an element of
    ``strategy.experimental_distribute_dataset(...)`` and returns the global mean loss.
    Every batch must have ``global_batch_size`` examples (batch with ``drop_remainder=True``):
    a shorter last batch would be divided by the wrong size.
    """
    checks.positive_int("global_batch_size", global_batch_size)
    checks.non_negative_number("l2", l2)
    kernels = [w for w in model.trainable_variables if len(w.shape) >= 2]

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
            if l2:
                loss += tf.nn.scale_regularization_loss(
                    l2 * tf.add_n([tf.reduce_sum(tf.square(k)) for k in kernels]))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function(autograph=False)
    def step(batch):
        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return step


class Mirrored:
    """A Keras model trained by ``MirroredStrategy`` over ``devices`` with Keras's own ``fit``.

    ``Mirrored(build, devices)`` calls ``build()`` inside ``strategy.scope()``: it must create
    *and compile* the model (Keras requires the model and its optimizer to be made under the
    scope; a model made outside cannot be moved in). ``m.model`` is that model: ``m.fit(...)``
    is ``m.model.fit(...)``, and the trained weights are in ``m.model`` when it returns.
    ``jit_compile=True`` is refused: XLA may override the per-replica placement.

    BatchNormalization: by default each replica normalises its own shard and updates its own
    copy of the moving statistics from it. Nothing keeps those copies in sync: under the
    strategy they are ``ON_WRITE`` variables with aggregation ``NONE``, so they diverge from
    the first step; ``predict`` under the strategy uses each replica's own, and
    ``get_weights`` / ``save`` give replica 0's (tested). ``BatchNormalization(
    synchronized=True)`` normalises over the whole global batch, which is what one device
    training on that batch does, and keeps the copies equal.
    """

    def __init__(self, build: Callable, devices: Sequence[str],
                 cross_device_ops: tf.distribute.CrossDeviceOps | None | str = "auto"):
        if not callable(build) or isinstance(build, tf.keras.Model):
            raise ValueError(f"build must be a function that creates and compiles the model "
                             f"inside the strategy's scope, got {type(build).__name__}")
        self.strategy = mirrored_strategy(devices, cross_device_ops)
        with self.strategy.scope():
            self.model = build()
        if not isinstance(self.model, tf.keras.Model) or getattr(self.model, "optimizer",
                                                                 None) is None:
            raise ValueError("build() must return a compiled Keras model (call model.compile "
                             "inside build, so that the optimizer is made under the scope)")
        if self.model.jit_compile:
            raise ValueError("the model was compiled with jit_compile=True (or 'auto' chose "
                             "XLA): compile with jit_compile=False under MirroredStrategy")

    @property
    def num_replicas(self) -> int:
        """How many replicas (devices) train the model."""
        return self.strategy.num_replicas_in_sync

    def fit(self, *args, **kwargs):
        """``self.model.fit(...)`` (the global batch is split over the replicas)."""
        return self.model.fit(*args, **kwargs)
