"""Single-machine data parallelism by hand: the "towers" recipe.

The towers recipe (one model replica, a *tower*, per device):

1. the variables live on one device (``variable_device``, classically the CPU);
2. the global batch is split into one shard per device (``split_batch``);
3. each tower runs the forward pass, the loss and the gradients of its shard under
   ``tf.device(its device)``;
4. the gradients are averaged (``average_gradients``) and applied once, on the variable device.

``make_tower_step`` builds that step as one ``tf.function`` for any model and list of devices;
``make_single_step`` is the one-device reference. Loss functions return *per-example* losses
(``accel.training``): a tower takes their mean over its shard. The same training with
``tf.distribute.MirroredStrategy`` is ``accel.parallel.mirrored``; TFRecord input is
``accel.parallel.inputs``. ``DataParallel(model, devices, loss, optimizer)`` is the recipe for
a Keras model, with ``fit`` and the weights written back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.devices import parse_device
from accel.parallel import keras_model as km
from accel.parallel.form import Form, device_list
from accel.training import make_update

__all__ = [
    "REMAINDERS", "MISSING", "split_batch", "average_gradients", "make_variables",
    "gradient_buckets", "make_tower_step", "make_single_step", "scaled_learning_rate",
    "DataParallel",
]

REMAINDERS = ("error", "pad", "drop")
MISSING = ("zero", "skip")


def _batch_size(tensors: list[tf.Tensor]) -> int:
    scalars = [t for t in tensors if t.shape.rank == 0]
    if scalars:
        raise ValueError(f"cannot split a scalar (shape []) into shards: got {scalars[0]!r}; "
                         "a batch has the examples along its first axis")
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError("all parts of a batch must have the same leading size, got "
                         f"{sorted(sizes, key=str)}")
    (size,) = sizes
    if size == 0:
        raise ValueError("the batch is empty (0 examples): nothing to split")
    if size is None:
        raise ValueError("the batch size must be known when the step is traced: batch the data "
                         "with drop_remainder=True or trace with a fixed-size input signature")
    return int(size)


def split_batch(batch, n: int, remainder: str = "error") -> list:
    """Split ``batch`` (a tensor, array, or a tuple/dict of them) into ``n`` shards along axis 0.

    ``remainder`` says what to do when the batch size ``b`` is not a multiple of ``n``:

    * ``"error"`` (default): ``ValueError`` naming ``b``, ``n`` and the shard sizes it would give;
    * ``"drop"``: drop the last ``b % n`` examples, so every shard has ``b // n``;
    * ``"pad"``: append copies of the first examples of the batch (wrapping around) until every
      shard has ``ceil(b / n)``. The copies count in the loss, so the step is no longer exactly
      the whole-batch step: use it only where a few repeated examples do not matter.

    Returns a list of ``n`` shards with the structure of ``batch``.
    """
    checks.positive_int("n", n)
    checks.one_of("remainder", remainder, REMAINDERS)
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(batch)]
    if not flat:
        raise ValueError("batch is empty: nothing to split")
    b = _batch_size(flat)
    extra = b % n
    if extra and remainder == "error":
        sizes = [b // n + (i < extra) for i in range(n)]
        raise ValueError(f"a batch of {b} examples does not split evenly into {n} shards "
                         f"(sizes would be {sizes}); use a batch size that is a multiple of {n}, "
                         "or remainder='pad' / 'drop'")
    if extra and remainder == "drop":
        if b < n:
            raise ValueError(f"remainder='drop' leaves nothing: batch {b} < {n} shards")
        flat = [t[: b - extra] for t in flat]
    elif extra:  # pad
        wrap = np.arange(n - extra) % b
        flat = [tf.concat([t, tf.gather(t, wrap)], axis=0) for t in flat]
    shards = [tf.split(t, n, axis=0) for t in flat]
    return [tf.nest.pack_sequence_as(batch, [s[i] for s in shards]) for i in range(n)]


def _average_slices(grads: list, have: list[int], n: int, missing: str,
                    weights: Sequence | None) -> tf.IndexedSlices:
    """The towers' ``IndexedSlices`` averaged as ``average_gradients`` averages dense ones,
    kept sparse: every tower's rows, each scaled by its tower's coefficient."""
    if weights is None:
        coefficients = [1.0 / (n if missing == "zero" else len(have))] * len(have)
    else:
        w = [weights[i] for i in have]
        norm = sum(w) if missing == "skip" else 1.0
        coefficients = [wi / norm for wi in w]
    return km.merge_gradients(grads, coefficients)


def average_gradients(tower_grads: Sequence[Sequence[tuple]], missing: str = "zero",
                      weights: Sequence | None = None, sparse: bool = False) -> list[tuple]:
    """Average per-tower ``(gradient, variable)`` lists into one list of ``(gradient, variable)``.

    ``tower_grads[i][j]`` is tower ``i``'s pair for variable ``j``; every tower must list the
    same variables in the same order. ``None`` gradients are tolerated: a variable whose gradient
    is ``None`` on every tower gets ``None`` (optimizers skip it). If only some towers have one,
    ``missing`` decides:

    * ``"zero"`` (default): a missing gradient counts as zero, so the result is the sum over the
      towers that have one divided by *all* towers -- exactly the gradient of the mean loss over
      the whole batch (the variable did not influence those towers' losses);
    * ``"skip"``: the mean over the towers that have one (what recipes that skip ``None`` do;
      TensorFlow's own CIFAR-10 multi-GPU example fails on a ``None`` instead), which weights
      those towers' examples more.

    ``weights``: one weight per tower (e.g. its share of the batch's examples, summing to 1) for
    towers whose shards differ in size; the result is then ``sum_i weights[i] * g_i`` (with
    ``"skip"``: renormalised over the towers that have a gradient). ``None``: equal weights.

    ``tf.IndexedSlices`` gradients (an ``Embedding``'s) are made dense first, unless
    ``sparse=True``: then they stay ``IndexedSlices`` holding every tower's rows, scaled, so
    that a Keras optimizer updates as ``model.fit`` on the whole batch does (Keras's Adam squares
    each row of a sparse gradient separately; ``accel.parallel.keras_model.merge_gradients``).
    The ops run on the current device, so call it under ``tf.device(variable_device)`` to
    average where the variables live.
    """
    checks.one_of("missing", missing, MISSING)
    if weights is not None and len(weights) != len(tower_grads):
        raise ValueError(f"weights has {len(weights)} entries for {len(tower_grads)} towers")
    if not tower_grads:
        raise ValueError("tower_grads is empty: need one (gradient, variable) list per tower")
    lengths = {len(t) for t in tower_grads}
    if len(lengths) != 1:
        raise ValueError(f"every tower must list the same variables; got lists of lengths "
                         f"{[len(t) for t in tower_grads]}")
    averaged = []
    for j, pairs in enumerate(zip(*tower_grads, strict=True)):
        var = pairs[0][1]
        if any(v is not var for _, v in pairs):
            raise ValueError(f"position {j}: the towers list different variables "
                             f"({[getattr(v, 'name', v) for _, v in pairs]})")
        have = [i for i, (g, _) in enumerate(pairs) if g is not None]
        if sparse and any(isinstance(pairs[i][0], tf.IndexedSlices) for i in have):
            averaged.append((_average_slices([pairs[i][0] for i in have], have, len(pairs),
                                             missing, weights), var))
            continue
        grads = [tf.convert_to_tensor(pairs[i][0]) for i in have]
        if not grads:
            averaged.append((None, var))
            continue
        if weights is not None:
            w = [tf.cast(weights[i], grads[0].dtype) for i in have]
            norm = tf.add_n(w) if missing == "skip" and len(w) > 1 else (
                w[0] if missing == "skip" else None)
            terms = [wi * g for wi, g in zip(w, grads, strict=True)]
            total = tf.add_n(terms) if len(terms) > 1 else terms[0]
            averaged.append((total / norm if norm is not None else total, var))
            continue
        count = len(pairs) if missing == "zero" else len(grads)
        total = tf.add_n(grads) if len(grads) > 1 else grads[0]
        averaged.append((total / float(count) if count > 1 else total, var))
    return averaged


def gradient_buckets(variables: Sequence, bucket_bytes: int) -> list[list[int]]:
    """The variables' positions grouped into buckets for a bucketed all-reduce, in the order a
    backward pass produces their gradients (the last variables first, as PyTorch DDP's
    ``bucket_cap_mb`` buckets): a bucket is closed when the next variable would take it past
    ``bucket_bytes`` or has another dtype; a variable larger than ``bucket_bytes`` is a bucket
    of its own."""
    checks.positive_int("bucket_bytes", bucket_bytes)
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for j in reversed(range(len(variables))):
        v = variables[j]
        nbytes = int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
        if not buckets or size + nbytes > bucket_bytes or v.dtype != dtype:
            buckets.append([])
            size, dtype = 0, v.dtype
        buckets[-1].append(j)
        size += nbytes
    return buckets


def _bucketed_average(grads: list[list], buckets: list[list[int]], devices: list[str],
                      variable_device: str, weights) -> dict[int, tf.Tensor]:
    """Position -> the towers' averaged gradient, for the positions whose gradient is dense on
    every tower: per bucket, each tower flattens and concatenates its gradients on its device
    (one tensor to send), the variable device adds them up (weighted by shard) and cuts the
    sum back into the variables' shapes, under name scope ``bucket_<k>``. Each bucket's sum
    depends only on its own gradients, so it runs as soon as they exist, while the backward
    pass still computes the earlier layers' (the overlap of DDP's bucketed all-reduce)."""
    out: dict[int, tf.Tensor] = {}
    dense = [j for j in range(len(grads[0])) if all(
        g[j] is not None and not isinstance(g[j], tf.IndexedSlices) for g in grads)]
    for k, bucket in enumerate(b for b in ([j for j in b if j in dense] for b in buckets) if b):
        with tf.name_scope(f"bucket_{k}"):
            flats = []
            for g, device in zip(grads, devices, strict=True):
                with tf.device(device):
                    flats.append(tf.concat([tf.reshape(g[j], [-1]) for j in bucket], 0))
            with tf.device(variable_device):
                if weights is None:
                    total = tf.add_n(flats) / float(len(flats)) if len(flats) > 1 else flats[0]
                else:
                    total = tf.add_n([tf.cast(w, f.dtype) * f
                                      for w, f in zip(weights, flats, strict=True)])
                pieces = tf.split(total, [int(np.prod(grads[0][j].shape)) for j in bucket])
                for j, piece in zip(bucket, pieces, strict=True):
                    out[j] = tf.reshape(piece, grads[0][j].shape)
    return out


def make_variables(arrays: Sequence, device: str) -> list[tf.Variable]:
    """``tf.Variable`` copies of ``arrays`` (e.g. ``models.mlp_init(...)``), on ``device``."""
    parse_device(device)
    with tf.device(device):
        return [tf.Variable(a, name=f"p{i}") for i, a in enumerate(arrays)]


def _model_parts(model_fn, params_or_model, device: str):
    """(forward(x) -> (prediction, added loss terms), trainable variables) for a Keras model
    (its ``model.losses`` after the call: regularizers, ``add_loss``) or a list of
    arrays/variables (no added terms)."""
    if isinstance(params_or_model, tf.keras.Model):
        model = params_or_model
        _check_variables_on(model.trainable_variables, device)

        def forward(x):
            pred = model(x, training=True)
            return pred, list(model.losses)

        return forward, list(model.trainable_variables)
    if model_fn is None:
        raise ValueError("model_fn is required unless params_or_model is a Keras model")
    params = list(params_or_model)
    if not params:
        raise ValueError("params_or_model is empty: nothing to train")
    if not all(isinstance(p, tf.Variable) for p in params):
        params = make_variables(params, device)
    _check_variables_on(params, device)
    return (lambda x: (model_fn(params, x), [])), params


def _loss(loss_fn, y, forward, x):
    """The batch's training loss: the mean of ``loss_fn`` plus the model's added terms (as
    Keras's ``Trainer.compute_loss``: ``accel.parallel.keras_model.training_loss``)."""
    pred, terms = forward(x)
    return km.training_loss(loss_fn, y, pred, terms)


def _check_variables_on(variables, device: str) -> None:
    """``ValueError`` naming the first variable that does not live on ``device``."""
    want = parse_device(device)
    for v in variables:
        # a Keras 3 variable holds its tf.Variable in .value
        where = v.device if isinstance(v, tf.Variable) else v.value.device
        got = parse_device(where)
        # a cluster's task counts too where the name gives it (/job:worker/task:1/...)
        if (got.device_type, got.device_index) != (want.device_type, want.device_index) or \
                any(w is not None and g != w for g, w in ((got.job, want.job),
                                                          (got.task or 0, want.task))):
            raise ValueError(f"variable {v.name!r} lives on {where!r}, not on the variable "
                             f"device {device!r}: create it under tf.device({device!r}) or "
                             "pass variable_device=its device")


def _shard_weights(xs: list) -> list | None:
    """``None`` if the shards have the same static size, else each shard's share of the
    examples (Python floats when sizes are known at tracing, tensors otherwise)."""
    sizes = [t.shape[0] for t in xs]
    if None not in sizes:
        if len(set(sizes)) == 1:
            return None
        return [s / sum(sizes) for s in sizes]
    counts = [tf.cast(tf.shape(t)[0], tf.float32) for t in xs]
    total = tf.add_n(counts)
    return [c / total for c in counts]


def make_tower_step(model_fn: Callable | None, loss_fn: Callable, params_or_model,
                    optimizer, devices: Sequence[str], variable_device: str | None = None,
                    remainder: str = "error", sparse: bool = False,
                    bucket_bytes: int | None = None):
    """One synchronous data-parallel training step over ``devices``, as a ``tf.function``.

    * ``model_fn(params, x)`` -> predictions (ignored when ``params_or_model`` is a Keras model);
    * ``loss_fn(y_true, y_pred)`` -> per-example losses; each tower minimises their mean;
    * ``params_or_model``: NumPy arrays (copied into new variables on ``variable_device``),
      existing ``tf.Variable`` s, or a Keras model (create it under ``tf.device(variable_device)``);
    * ``optimizer``: a learning rate (plain SGD) or an optimizer with ``apply_gradients``.

    Placement promised (checked by ``accel.placement`` in the tests): each tower's forward and
    backward ops (its ``MatMul`` s) run on its own device, under name scope ``tower_<i>``; the
    variables, their reads for the update, the averaging and the update
    (``ResourceApplyGradientDescent`` for plain SGD) run on ``variable_device``
    (default ``devices[0]``). The step ``step(x, y)`` takes a whole batch (split here with
    ``split_batch(..., remainder)``) or tuples of ``len(devices)`` per-tower shards (a tuple or
    list ``x`` is always read as shards, one per device; shards of different sizes are weighted
    by their share of the examples, so the update is still the whole batch's), and returns the
    batch's mean loss (plus a Keras model's ``model.losses``, as ``fit`` adds them: each tower
    adds its own call's terms, and the towers' gradients are averaged, so a regularizer counts
    once). ``sparse=True``: embedding gradients stay ``IndexedSlices``
    (``average_gradients``; needs an optimizer object). ``step.variables`` are the trained
    variables. ``bucket_bytes``: the dense gradients are averaged in buckets of about that
    many bytes (``gradient_buckets``: one send per tower per bucket, each bucket's sum issued
    as soon as its gradients exist, overlapping the rest of the backward pass; the buckets are
    ``step.buckets``); ``None``: variable by variable, as ``average_gradients`` does. The
    step is traced without AutoGraph, like Keras's own train step:
    ``model_fn``, ``loss_fn`` and the model's ``call`` must not branch in Python on a tensor's
    value (use ``tf.cond`` / ``keras.ops.cond``).
    """
    devices = [parse_device(d).to_string() for d in devices]
    if not devices:
        raise ValueError("devices is empty: give at least one device name")
    variable_device = parse_device(variable_device or devices[0]).to_string()
    forward, variables = _model_parts(model_fn, params_or_model, variable_device)
    update = make_update(optimizer, variables, variable_device)
    n = len(devices)
    buckets = None if bucket_bytes is None else gradient_buckets(variables, bucket_bytes)

    # no AutoGraph: the step's control flow is Python's, settled at tracing (as in Keras's own
    # train step); converting the model, loss and optimizer code made the first call ~4x slower
    @tf.function(autograph=False)
    def step(x, y):
        if isinstance(x, (tuple, list)):
            if len(x) != n or len(y) != n:
                raise ValueError(f"got {len(x)} x shards and {len(y)} y shards for {n} devices")
            shards = list(zip(x, y, strict=True))
        else:
            shards = split_batch((x, y), n, remainder)
        weights = _shard_weights([xs for xs, _ in shards])
        tower_grads, losses = [], []
        for i, (device, (xs, ys)) in enumerate(zip(devices, shards, strict=True)):
            with tf.device(device), tf.name_scope(f"tower_{i}"):
                with tf.GradientTape() as tape:
                    loss = _loss(loss_fn, ys, forward, xs)
                # a LossScaleOptimizer's scale seeds the backward (fit scales the loss)
                grads = tape.gradient(loss, variables,
                                      output_gradients=km.loss_scale(optimizer, loss.dtype))
            tower_grads.append(list(zip(grads, variables, strict=True)))
            losses.append(loss)
        done = {} if buckets is None else _bucketed_average(
            [[g for g, _ in pairs] for pairs in tower_grads], buckets, devices, variable_device,
            weights)
        with tf.device(variable_device), tf.name_scope("update"):
            rest = [j for j in range(len(variables)) if j not in done]
            averaged = dict(zip(rest, average_gradients(
                [[pairs[j] for j in rest] for pairs in tower_grads], weights=weights,
                sparse=sparse), strict=True)) if rest else {}
            averaged.update({j: (g, variables[j]) for j, g in done.items()})
            update([averaged[j] for j in range(len(variables))])
            if weights is None:
                return tf.add_n(losses) / float(n)
            return tf.add_n([w * loss for w, loss in zip(weights, losses, strict=True)])

    step.variables, step.buckets = variables, buckets
    return step


def make_single_step(model_fn: Callable | None, loss_fn: Callable, params_or_model, optimizer,
                     device: str):
    """The reference: one ordinary training step on the whole batch, everything on ``device``.
    Same arguments as ``make_tower_step``; ``step(x, y)`` returns the batch's mean loss."""
    device = parse_device(device).to_string()
    forward, variables = _model_parts(model_fn, params_or_model, device)
    update = make_update(optimizer, variables, device)

    @tf.function(autograph=False)
    def step(x, y):
        with tf.device(device):
            with tf.GradientTape() as tape:
                loss = _loss(loss_fn, y, forward, x)
            grads = tape.gradient(loss, variables,
                                  output_gradients=km.loss_scale(optimizer, loss.dtype))
            update(list(zip(grads, variables, strict=True)))
            return loss

    step.variables = variables
    return step



def scaled_learning_rate(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule (Goyal et al. 2017): when the batch grows k times, multiply the
    learning rate by k (with a warm-up for large k)."""
    checks.positive_number("base_lr", base_lr)
    checks.positive_int("base_batch", base_batch)
    checks.positive_int("global_batch", global_batch)
    return base_lr * global_batch / base_batch


class DataParallel(Form):
    """The towers recipe for a Keras model (any model ``keras.models.clone_model`` can copy).

    ``DataParallel(model, devices, loss=..., optimizer=...)`` trains a working copy of
    ``model`` whose variables (and, the optimizer being built there, its slots) live on
    ``variable_device`` (default ``devices[0]``); every step splits the batch into one shard
    per device, each tower runs the copy's forward and backward on its shard under
    ``tf.device``, and the averaged gradients are applied once (``make_tower_step``).
    ``train_step``, ``fit`` (Keras's habits; batches a multiple of the number of devices) and
    ``write_back`` are ``accel.parallel.form.Form``'s.

    What it trains is what ``fit`` trains: the loss plus ``model.losses`` (regularizers,
    ``add_loss``), each tower adding its own call's terms, the towers' gradients averaged (as
    Keras under a ``tf.distribute`` strategy). An ``Embedding``'s gradient stays sparse (every
    tower's rows), so Keras's optimizers update as ``model.fit`` on one device does.
    ``bucket_bytes``: the dense gradients are averaged bucket by bucket, each bucket as soon as
    the backward pass has made it (``make_tower_step``; PyTorch DDP's buckets).

    BatchNormalization: each tower normalises its own shard and updates the moving statistics
    from it, tower after tower (per-replica batch norm): with an optimizer without bias
    correction (SGD) the step equals ``fit`` on the ``n`` shards in turn with
    ``gradient_accumulation_steps=n``; ``MirroredStrategy`` with
    ``BatchNormalization(synchronized=True)`` normalises over the whole batch instead.
    """

    name = "data"
    options = ("variable_device", "bucket_bytes")

    def __init__(self, model, devices: Sequence[str], *, loss, optimizer,
                 variable_device: str | None = None, bucket_bytes: int | None = None):
        self.devices = device_list(devices)
        self.variable_device = parse_device(variable_device or self.devices[0]).to_string()
        self.model = model
        self.copy = km.copy_model(model, self.variable_device)
        self.optimizer = self.make_optimizer(optimizer)
        self._tower_step = make_tower_step(None, km.loss_function(loss), self.copy,
                                           self.optimizer, self.devices, self.variable_device,
                                           sparse=True, bucket_bytes=bucket_bytes)

    def _step(self, x, y):
        return self._tower_step(x, y)

    def batch_parts(self) -> int:
        return len(self.devices)

    def write_back(self) -> None:
        self.model.set_weights(self.copy.get_weights())

    def working_variables(self) -> list:
        return list(self.copy.weights)

    def optimizer_variables(self) -> list:
        return list(self.optimizer.variables)
