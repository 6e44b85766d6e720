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
  The same function runs in each ``MultiWorkerMirroredStrategy`` worker process (every worker
  reads the whole data set; auto-sharding by DATA gives worker ``i`` slice ``i`` of each global
  batch), checkpoints and resumes (``checkpoint_dir``, ``every``), and under
  ``ParameterServerStrategy`` (in the coordinator) schedules the same step through a
  ``ClusterCoordinator``: one function per step on whichever worker is free, each reading from its
  worker's own dataset (``create_per_worker_dataset``), then ``coordinator.join()``.

For a model without batch statistics or randomness, every synchronous strategy ends with the
weights of one device trained on the same global batches (tested). The hand-written towers
version is ``accel.parallel.data.make_tower_step``; ``accel.parallel.mirrored`` has the step alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from accel import checks
from accel.devices import parse_device
from accel.parallel.mirrored import make_mirrored_step
from accel.training import squared_error

__all__ = ["KINDS", "CROSS_DEVICE_OPS", "INPUTS", "make_strategy", "make_cross_device_ops",
           "LoopResult", "train_loop", "is_parameter_server"]

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
    the trained ``model``; ``start``: the step it began at (after a resume from a checkpoint),
    ``updates``: the optimizer's update count at the end (``optimizer.iterations``, a variable on
    the ps under ``ParameterServerStrategy``: the updates the ps really applied); ``taken``:
    under ``ParameterServerStrategy``, one ``(worker, batch)`` per scheduled step, in the order
    they were scheduled: which worker ran it and which global batch (1-based) it trained on."""

    weights: list
    losses: list
    mean_loss: float
    model: object
    start: int = 0
    updates: int = 0
    taken: list = field(default_factory=list)


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` is TF2's ``ParameterServerStrategy`` (driven by a coordinator)."""
    return isinstance(strategy, tf.distribute.ParameterServerStrategy)


def _batches(x, y, global_batch_size: int, steps: int, start: int = 0) -> tf.data.Dataset:
    n = len(x)
    if len(y) != n:
        raise ValueError(f"x and y differ in length: {n} vs {len(y)}")
    if n < global_batch_size:
        raise ValueError(f"global_batch_size={global_batch_size} is larger than the data ({n})")
    per_epoch = n // global_batch_size
    epochs = -(-steps // per_epoch)
    options = tf.data.Options()  # across workers: worker i takes slice i of every global batch
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size, drop_remainder=True)
            .repeat(epochs).take(steps).skip(start).with_options(options))


def train_loop(strategy: tf.distribute.Strategy, make_model: Callable[[], tf.keras.Model],
               x: np.ndarray, y: np.ndarray, global_batch_size: int, steps: int,
               learning_rate: float = 0.1, loss_fn: Callable = squared_error, l2: float = 0.0,
               inputs: str = "dataset", checkpoint_dir: str | None = None, every: int = 0,
               after_step: Callable[[int], None] | None = None) -> LoopResult:
    """Train ``make_model()`` with SGD(``learning_rate``) under ``strategy`` for ``steps`` steps.

    The data ``(x, y)`` is cut into global batches of ``global_batch_size`` in order (last
    partial batch dropped, repeated as needed). ``inputs="dataset"`` hands the batched dataset to
    ``experimental_distribute_dataset`` (each global batch split across replicas);
    ``inputs="function"`` calls ``distribute_datasets_from_function`` with a function batching by
    the per-replica size (``input_context.get_per_replica_batch_size``) and sharding by input
    pipeline (one per worker): the replicas take consecutive per-replica batches, i.e. the same
    global batches. ``loss_fn(y_true, y_pred)`` gives per-example losses; ``l2`` adds
    ``l2 * sum(kernel**2)``.

    ``checkpoint_dir``: restore model, optimizer and step count from its latest checkpoint (if
    any) and go on from that step; with ``every`` save one there every ``every`` steps
    (``tf.train.CheckpointManager``; across workers the chief writes into ``checkpoint_dir`` and
    the others into sub-directories of their own, as TensorFlow asks, since every worker must
    take part in the save). ``after_step(s)`` is called on the host after step ``s`` (1-based)
    and its checkpoint.

    Under ``ParameterServerStrategy`` (run in the coordinator): the step is scheduled ``steps``
    times with ``ClusterCoordinator.schedule``; each call takes the next batch of the worker it
    lands on (``create_per_worker_dataset``: every worker iterates the same dataset on its own,
    TensorFlow does not split it between them), and ``coordinator.join()`` waits for all;
    ``LoopResult.taken`` records which worker ran each step on which batch. Checkpoints and
    ``after_step`` are for synchronous strategies only.
    """
    checks.positive_int("global_batch_size", global_batch_size)
    checks.positive_int("steps", steps)
    checks.positive_number("learning_rate", learning_rate)
    checks.non_negative_number("l2", l2)
    checks.one_of("inputs", inputs, INPUTS)
    checks.non_negative_int("every", every)
    if every and checkpoint_dir is None:
        raise ValueError(f"every={every} needs a checkpoint_dir to save into")
    ps = is_parameter_server(strategy)
    if ps and (checkpoint_dir is not None or after_step is not None):
        raise ValueError("checkpoint_dir and after_step need a step that ends on this host; "
                         "under ParameterServerStrategy the steps run asynchronously on the "
                         "workers: checkpoint from the coordinator between join()s instead")
    replicas = strategy.num_replicas_in_sync
    if inputs == "function" and global_batch_size % replicas:
        raise ValueError(f"global_batch_size={global_batch_size} does not split evenly over "
                         f"{replicas} replicas (needed by inputs='function')")
    _batches(x, y, global_batch_size, steps)  # checks the data before any variable is made
    with strategy.scope():
        model = make_model()
        optimizer = tf.keras.optimizers.SGD(learning_rate)
        mean_loss = tf.keras.metrics.Mean()
        done = tf.Variable(0, dtype=tf.int64, trainable=False)
    manager = _checkpoints(strategy, model, optimizer, done, checkpoint_dir)
    start = int(done.numpy())
    step = make_mirrored_step(strategy, model, loss_fn, optimizer, global_batch_size, l2)

    # The datasets repeat without end and the loop takes what it needs: with a finite dataset a
    # multi-worker iterator all-reduces "has every worker still data?" before every step.
    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = ctx.get_per_replica_batch_size(global_batch_size)
        return (_batches(x, y, global_batch_size, steps, start).unbatch()
                .batch(per_replica, drop_remainder=True)
                .shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat())

    losses, taken = [], []
    if ps:
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

        def numbered_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
            # each element also carries its global batch's number, 1..steps (then again)
            numbers = tf.data.Dataset.range(1, steps + 1).repeat()
            return tf.data.Dataset.zip((dataset_fn(ctx), numbers))

        per_worker = coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(numbered_fn))
        iterator = iter(per_worker)

        @tf.function(autograph=False)
        def scheduled_step(it):
            batch, number = next(it)
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            return step(batch), number, worker

        scheduled = [coordinator.schedule(scheduled_step, args=(iterator,))
                     for _ in range(steps)]
        coordinator.join()
        for result in scheduled:
            loss, number, worker = result.fetch()
            losses.append(float(loss))
            taken.append((int(worker), int(number)))
            mean_loss.update_state(losses[-1])
    else:
        if inputs == "dataset":
            dist = strategy.experimental_distribute_dataset(
                _batches(x, y, global_batch_size, steps, start).repeat())
        else:
            dist = strategy.distribute_datasets_from_function(dataset_fn)
        batches = iter(dist)
        for s in range(start + 1, steps + 1):
            loss = step(next(batches))
            mean_loss.update_state(loss)
            losses.append(float(loss))
            done.assign(s)
            if every and s % every == 0:
                manager.save(checkpoint_number=s)
            if after_step is not None:
                after_step(s)
    return LoopResult([np.asarray(w) for w in model.weights], losses,
                      float(mean_loss.result()), model, start, int(optimizer.iterations.numpy()),
                      taken)


def _checkpoints(strategy, model, optimizer, done, checkpoint_dir: str | None):
    """Restore the latest checkpoint of ``checkpoint_dir`` (if any) and return the manager that
    saves the next ones (``None`` without a directory). Across workers only the chief's copy is
    kept: the others write into ``worker_<i>`` sub-directories (TensorFlow's multi-worker
    checkpointing recipe)."""
    if checkpoint_dir is None:
        return None
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=done)
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    if latest:
        checkpoint.restore(latest).assert_existing_objects_matched()
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    task_id = getattr(resolver, "task_id", 0) or 0
    chief = task_type in (None, "chief") or (task_type == "worker" and task_id == 0)
    own = checkpoint_dir if chief else os.path.join(checkpoint_dir, f"worker_{task_id}")
    return tf.train.CheckpointManager(checkpoint, own, max_to_keep=2)
