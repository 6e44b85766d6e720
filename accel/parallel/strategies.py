"""``tf.distribute`` strategies by name, and ONE custom training loop that runs under any of them.

* ``make_strategy(kind, devices, cross_device_ops=None)``: ``"default"`` (the strategy in effect
  outside any scope: code written for strategies runs unchanged without one), ``"one_device"``,
  ``"mirrored"`` (one replica per device, variables mirrored, gradients all-reduced) and
  ``"central_storage"`` (one replica per device, variables kept once on a parameter device: the
  classic "variables on the CPU" recipe). ``cross_device_ops`` picks how ``"mirrored"`` sums
  gradients: ``"reduction_to_one_device"``, ``"hierarchical_copy"``, ``"nccl"`` (GPUs only) or
  ``None`` (the strategy's default).
* ``train_loop(strategy, make_model, x, y, ...)``: the loop of TensorFlow's guide "Custom training
  with tf.distribute.Strategy": model, optimizer and metric created in ``strategy.scope()``, input
  from ``experimental_distribute_dataset`` or ``distribute_datasets_from_function``, per-example
  losses divided by the *global* batch size (``tf.nn.compute_average_loss``), the regularisation
  term by the number of replicas (``tf.nn.scale_regularization_loss``), ``strategy.run`` per
  replica and ``strategy.reduce`` for the step's loss. Returns the final weights and the losses.

For a model without batch statistics or randomness, every synchronous strategy ends with the
weights of one device trained on the same global batches (tested). The hand-written towers
version is ``accel.parallel.data.make_tower_step``; ``accel.parallel.mirrored`` has the step alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from accel import checks
from accel.devices import parse_device
from accel.parallel.mirrored import make_mirrored_step
from accel.training import squared_error

__all__ = ["KINDS", "CROSS_DEVICE_OPS", "INPUTS", "make_strategy", "make_cross_device_ops",
           "LoopResult", "train_loop"]

KINDS = ("default", "one_device", "mirrored", "central_storage")
CROSS_DEVICE_OPS = ("reduction_to_one_device", "hierarchical_copy", "nccl")
INPUTS = ("dataset", "function")


def make_cross_device_ops(name: str, devices: Sequence[str]) -> tf.distribute.CrossDeviceOps:
    """The ``CrossDeviceOps`` called ``name`` for a ``MirroredStrategy`` over ``devices``.

    ``"reduction_to_one_device"``: copy every replica's tensor to one device (the first of the
    destination), add there, copy the sum back; ``"hierarchical_copy"``: the DGX-1 recipe (sum
    within two groups of ``n // 2`` GPUs, then across the groups; an even ``n`` only: with an odd
    one TensorFlow 2.21 silently leaves a replica out); ``"nccl"``: NVIDIA's NCCL all-reduce,
    GPUs only.
    """
    checks.one_of("cross_device_ops", name, CROSS_DEVICE_OPS)
    if name == "reduction_to_one_device":
        return tf.distribute.ReductionToOneDevice()
    if name == "hierarchical_copy":
        if len(devices) % 2:
            raise ValueError(f"cross_device_ops='hierarchical_copy' needs an even number of "
                             f"devices, got {len(devices)}: TensorFlow's version sums two groups "
                             f"of n // 2 replicas, so with an odd n one replica's gradients "
                             f"are left out")
        return tf.distribute.HierarchicalCopyAllReduce()
    not_gpu = [d for d in devices if parse_device(d).device_type != "GPU"]
    if not_gpu:
        raise ValueError(f"cross_device_ops='nccl' needs GPUs (NCCL runs between NVIDIA GPUs); "
                         f"{not_gpu} are not: use 'reduction_to_one_device' or "
                         f"'hierarchical_copy' on CPUs")
    return tf.distribute.NcclAllReduce()


def make_strategy(kind: str, devices: Sequence[str], cross_device_ops: str | None = None,
                  ) -> tf.distribute.Strategy:
    """The strategy ``kind`` over ``devices`` (full names, e.g. ``/device:CPU:1``).

    * ``"default"``: ``tf.distribute.get_strategy()`` outside any scope, one replica, no
      placement of its own (TensorFlow's usual placement applies); ``devices`` must name one
      device, the one that placement picks (the first GPU, else the first CPU);
    * ``"one_device"``: ``OneDeviceStrategy`` on the one device of ``devices``;
    * ``"mirrored"``: ``MirroredStrategy`` over ``devices`` with ``cross_device_ops``;
    * ``"central_storage"``: ``CentralStorageStrategy`` computing on ``devices``, variables on
      the CPU (TensorFlow's choice of parameter device when there are several compute devices).

    ``cross_device_ops`` is for ``"mirrored"`` only; elsewhere it must be ``None``.
    """
    checks.one_of("kind", kind, KINDS)
    names = [parse_device(d).to_string() for d in devices]
    if not names:
        raise ValueError("devices is empty: give at least one device name")
    if len(set(names)) != len(names):
        raise ValueError(f"devices repeats a device: {names}")
    if cross_device_ops is not None and kind != "mirrored":
        raise ValueError(f"cross_device_ops applies to kind='mirrored' only, got "
                         f"cross_device_ops={cross_device_ops!r} with kind={kind!r}")
    if kind in ("default", "one_device") and len(names) != 1:
        raise ValueError(f"kind={kind!r} runs on one device, got {len(names)} devices {names}: "
                         f"pass one of them")
    if kind == "default":
        if tf.distribute.has_strategy():
            raise ValueError("kind='default' must be made outside any strategy.scope()")
        return tf.distribute.get_strategy()
    if kind == "one_device":
        return tf.distribute.OneDeviceStrategy(names[0])
    if kind == "central_storage":
        return tf.distribute.experimental.CentralStorageStrategy(compute_devices=names)
    ops = None if cross_device_ops is None else make_cross_device_ops(cross_device_ops, names)
    return tf.distribute.MirroredStrategy(devices=names, cross_device_ops=ops)


@dataclass
class LoopResult:
    """What ``train_loop`` returns: the final ``weights`` (NumPy, in ``model.weights`` order), the
    global mean loss of each step (``losses``, data term + regularisation), the mean of those
    losses as a ``keras.metrics.Mean`` created under the strategy saw them (``mean_loss``), and
    the trained ``model``."""

    weights: list
    losses: list
    mean_loss: float
    model: object


def _batches(x, y, global_batch_size: int, steps: int) -> tf.data.Dataset:
    n = len(x)
    if len(y) != n:
        raise ValueError(f"x and y differ in length: {n} vs {len(y)}")
    if n < global_batch_size:
        raise ValueError(f"global_batch_size={global_batch_size} is larger than the data ({n})")
    per_epoch = n // global_batch_size
    epochs = -(-steps // per_epoch)
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size, drop_remainder=True)
            .repeat(epochs).take(steps))


def train_loop(strategy: tf.distribute.Strategy, make_model: Callable[[], tf.keras.Model],
               x: np.ndarray, y: np.ndarray, global_batch_size: int, steps: int,
               learning_rate: float = 0.1, loss_fn: Callable = squared_error, l2: float = 0.0,
               inputs: str = "dataset") -> LoopResult:
    """Train ``make_model()`` with SGD(``learning_rate``) under ``strategy`` for ``steps`` steps.

    The data ``(x, y)`` is cut into global batches of ``global_batch_size`` in order (last
    partial batch dropped, repeated as needed). ``inputs="dataset"`` hands the batched dataset to
    ``experimental_distribute_dataset`` (each global batch split across replicas);
    ``inputs="function"`` calls ``distribute_datasets_from_function`` with a function batching by
    the per-replica size (``input_context.get_per_replica_batch_size``): on one machine the
    replicas take consecutive per-replica batches, i.e. the same global batches.
    ``loss_fn(y_true, y_pred)`` gives per-example losses; ``l2`` adds ``l2 * sum(kernel**2)``.
    """
    checks.positive_int("global_batch_size", global_batch_size)
    checks.positive_int("steps", steps)
    checks.positive_number("learning_rate", learning_rate)
    checks.non_negative_number("l2", l2)
    checks.one_of("inputs", inputs, INPUTS)
    replicas = strategy.num_replicas_in_sync
    if inputs == "function" and global_batch_size % replicas:
        raise ValueError(f"global_batch_size={global_batch_size} does not split evenly over "
                         f"{replicas} replicas (needed by inputs='function')")
    dataset = _batches(x, y, global_batch_size, steps)
    with strategy.scope():
        model = make_model()
        optimizer = tf.keras.optimizers.SGD(learning_rate)
        mean_loss = tf.keras.metrics.Mean()
    if inputs == "dataset":
        dist = strategy.experimental_distribute_dataset(dataset)
    else:
        def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            per_replica = ctx.get_per_replica_batch_size(global_batch_size)
            return dataset.unbatch().batch(per_replica, drop_remainder=True)
        dist = strategy.distribute_datasets_from_function(dataset_fn)
    step = make_mirrored_step(strategy, model, loss_fn, optimizer, global_batch_size, l2)

    losses = []
    for batch in dist:
        loss = step(batch)
        mean_loss.update_state(loss)
        losses.append(float(loss))
    return LoopResult([np.asarray(w) for w in model.weights], losses,
                      float(mean_loss.result()), model)
