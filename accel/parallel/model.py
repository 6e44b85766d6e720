"""Model parallelism: one model's layers cut into consecutive parts, one part per device.

The pieces, all plain data so that pipelines (chapter 10) can reuse them:

* a **layer** is a Keras layer or a pair ``(fn, arrays)``, described (and checked to chain) by
  ``accel.parallel.layers.describe_layers`` as a ``LayerSpec``;
* ``split(layers, devices, input_shape, balance)`` cuts them into a ``Partition``: ``balance`` is
  ``"count"`` (equal layer counts), ``"bytes"`` (equal parameter bytes), ``"time"`` (equal
  measured time, with ``times=accel.parallel.layers.layer_times(...)``) or an explicit list of
  part sizes.
  ``Partition.parts`` are ``Part`` rows: index, device, layer indices, parameter bytes, output
  shape. A *stage* of a pipeline is one part: its layers on its device;
* ``SplitModel(partition)`` creates each part's variables on its device; ``run_part`` runs one;
* ``make_split_step(model, loss_fn, optimizer)``: one training step as a ``tf.function``; each
  part's forward and backward ops run under ``tf.device(its device)``, only activations
  (forward) and their gradients (backward) cross devices. ``replicas=[[devices of replica 0],
  [devices of replica 1], ...]`` adds data parallelism (hybrid): the batch is split over the
  replicas, every replica runs all parts on its own devices, part ``p``'s gradients are averaged
  on the device holding its variables. Each part keeps its own ``GradientTape`` and calls
  ``tape.gradient`` under its device: in TF 2.21 a tape's gradient ops are not placed with
  their forward ops but follow the device scope around the ``gradient()`` call (with none, they
  land on one device and pull every activation there); ``tf.gradients`` inside a
  ``tf.function`` does colocate them. An optimizer object builds its slots where it
  is first built; a learning rate (plain SGD) needs no slots;
* ``ModelParallel(model, devices | replicas, loss, optimizer)``: the same for a Keras
  ``Sequential`` (working copies of each part on its device, weights written back), and the
  hybrid with every part replicated and its gradients all-reduced among its copies;
* ``build_graph(partition, loss_fn, learning_rate, x_shape, y_shape)``: the same step in TF1 form
  (a ``tf.Graph`` with ``tf.device`` per part, ``GradientDescentOptimizer`` with gradients
  colocated), to run in a session with ``accel.placement.session_config()``.

What crossed between devices in a run, and when each device was busy: ``accel.parallel.trace``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import tensorflow as tf

from accel import checks
from accel.collectives import all_reduce
from accel.devices import parse_device
from accel.parallel import graph
from accel.parallel import keras_model as km
from accel.parallel.data import average_gradients, split_batch
from accel.parallel.form import Form, device_list
from accel.parallel.layers import LayerSpec, describe_layers, run_layers
from accel.parallel.partition import balance_by_cost, balance_by_count, check_balance, part_ranges
from accel.training import make_update

__all__ = ["Part", "Partition", "BALANCES", "split", "SplitModel", "make_split_step",
           "ModelParallel", "SplitGraph", "build_graph"]

BALANCES = ("count", "bytes", "time")


@dataclass(frozen=True)
class Part:
    """One part of a partition: which layers run on which device."""

    index: int
    device: str
    layers: tuple[int, ...]
    names: tuple[str, ...]
    param_bytes: int
    output_shape: tuple


@dataclass(frozen=True)
class Partition:
    """Consecutive parts of a layer sequence, one per device (``parts`` are plain rows)."""

    parts: tuple[Part, ...]
    input_shape: tuple
    specs: tuple[LayerSpec, ...] = field(repr=False)

    @property
    def balance(self) -> list[int]:
        return [len(p.layers) for p in self.parts]

    @property
    def devices(self) -> list[str]:
        return [p.device for p in self.parts]

    def boundary_bytes(self, batch: int, dtype_size: int = 4) -> list[int]:
        """Bytes of the activation crossing each boundary between consecutive parts (the same
        again crosses back as its gradient): ``batch`` x the part's output size x dtype size."""
        checks.positive_int("batch", batch)
        return [batch * math.prod(p.output_shape) * dtype_size for p in self.parts[:-1]]

    def format(self) -> str:
        """One line per part: device, layers, parameter bytes, output shape per example."""
        lines = [f"{'part':>4}  {'device':14}  {'layers':18}  {'param bytes':>11}  output"]
        for p in self.parts:
            layers = f"{p.layers[0]}..{p.layers[-1]}" if len(p.layers) > 1 else f"{p.layers[0]}"
            lines.append(f"{p.index:>4}  {p.device:14}  {layers + f' ({len(p.layers)})':18}  "
                         f"{p.param_bytes:>11,}  {list(p.output_shape)}")
        return "\n".join(lines)


def split(layers: Sequence, devices: Sequence[str], input_shape: Sequence[int],
          balance: str | Sequence[int] = "count", times: Sequence[float] | None = None
          ) -> Partition:
    """Cut ``layers`` (Keras layers, ``(fn, arrays)`` pairs, or ``LayerSpec`` s) into one
    consecutive part per device of ``devices``; see the module docstring for ``balance``."""
    devices = list(devices)
    if not devices:
        raise ValueError("devices is empty: give one device name per part")
    names = [parse_device(d).to_string() for d in devices]
    specs = list(layers) if layers and all(isinstance(s, LayerSpec) for s in layers) \
        else describe_layers(layers, input_shape)
    n = len(specs)
    if isinstance(balance, str):
        checks.one_of("balance", balance, BALANCES)
        if balance == "count":
            sizes = balance_by_count(n, len(names))
        elif balance == "bytes":
            sizes = balance_by_cost([s.param_bytes for s in specs], len(names))
        else:
            if times is None or len(times) != n:
                raise ValueError(f"balance='time' needs times= with one time per layer ({n}), "
                                 f"got {None if times is None else len(times)}")
            sizes = balance_by_cost(list(times), len(names))
    else:
        sizes = check_balance(balance, n)
        if len(sizes) != len(names):
            raise ValueError(f"balance {sizes} has {len(sizes)} parts for {len(names)} devices")
    parts = tuple(
        Part(i, dev, tuple(r), tuple(specs[j].name for j in r),
             sum(specs[j].param_bytes for j in r), specs[r[-1]].output_shape)
        for i, (dev, r) in enumerate(zip(names, part_ranges(sizes), strict=True)))
    return Partition(parts, tuple(int(d) for d in input_shape), tuple(specs))


class SplitModel:
    """A partition with variables: part ``p``'s layers' variables live on its device."""

    def __init__(self, partition: Partition):
        self.partition = partition
        self.params: list[list[list[tf.Variable]]] = []  # [part][layer in part][weight]
        for part in partition.parts:
            with tf.device(part.device):
                self.params.append([[tf.Variable(a, name=f"part{part.index}_layer{j}_w{k}")
                                     for k, a in enumerate(partition.specs[j].arrays)]
                                    for j in part.layers])

    def variables(self, part: int | None = None) -> list[tf.Variable]:
        """All variables in layer order, or those of one part."""
        chosen = self.params if part is None else [self.params[part]]
        return [v for p in chosen for layer in p for v in layer]

    def run_part(self, p: int, x):
        """Part ``p``'s layers on ``x`` (under the caller's device scope)."""
        part = self.partition.parts[p]
        return run_layers([self.partition.specs[j] for j in part.layers], self.params[p], x)

    def __call__(self, x):
        for p, part in enumerate(self.partition.parts):
            with tf.device(part.device):
                x = self.run_part(p, x)
        return x


def _check_replicas(replicas, num_parts: int) -> list[list[str]]:
    out = []
    for r, devs in enumerate(replicas):
        if len(devs) != num_parts:
            raise ValueError(f"replica {r} lists {len(devs)} devices for {num_parts} parts")
        out.append([parse_device(d).to_string() for d in devs])
    if not out:
        raise ValueError("replicas is empty: give one list of devices per replica")
    return out


def make_split_step(model: SplitModel | Partition, loss_fn: Callable, optimizer,
                    replicas: Sequence[Sequence[str]] | None = None):
    """One training step of a split model as a ``tf.function`` ``step(x, y) -> mean loss``.

    ``loss_fn(y_true, y_pred)`` returns per-example losses; ``optimizer`` is a learning rate
    (plain SGD, applied on each variable's device) or an optimizer. ``step.model`` is the
    ``SplitModel`` (a ``Partition`` is given variables first); ``step.gradients(x, y)`` returns
    the loss and the gradients (in ``step.model.variables()`` order) without applying them."""
    model = model if isinstance(model, SplitModel) else SplitModel(model)
    parts = model.partition.parts
    reps = _check_replicas(replicas or [[p.device for p in parts]], len(parts))
    variables = model.variables()
    update = make_update(optimizer, variables)

    def one_replica(r, devs, x, y):
        grads = [None] * len(parts)
        saved, h, loss = [], x, None
        for p, dev in enumerate(devs):
            with tf.device(dev), tf.name_scope(f"r{r}_forward_{p}"):
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    out = model.run_part(p, h)
                    if p == len(devs) - 1:
                        loss = tf.reduce_mean(loss_fn(y, out))
            saved.append((tape, h, out))
            h = out
        upstream = None
        for p in reversed(range(len(devs))):
            tape, inp, out = saved[p]
            with tf.device(devs[p]), tf.name_scope(f"r{r}_backward_{p}"):
                target, seed = (loss, None) if upstream is None else (out, upstream)
                g = tape.gradient(target, [inp, *model.variables(p)], output_gradients=seed)
            upstream, grads[p] = g[0], g[1:]
        return loss, [gv for p in range(len(parts)) for gv in grads[p]]

    def compute(x, y):
        shards = split_batch((x, y), len(reps)) if len(reps) > 1 else [(x, y)]
        losses, tower = [], []
        for r, (devs, (xs, ys)) in enumerate(zip(reps, shards, strict=True)):
            loss, grads = one_replica(r, devs, xs, ys)
            losses.append(loss)
            tower.append(list(zip(grads, variables, strict=True)))
        pairs = []
        for p, part in enumerate(parts):
            with tf.device(part.device), tf.name_scope(f"update_{p}"):
                own = [[gv for gv in t if any(gv[1] is v for v in model.variables(p))]
                       for t in tower]
                pairs += average_gradients(own) if len(reps) > 1 else own[0]
        return tf.add_n(losses) / float(len(losses)), pairs

    @tf.function(autograph=False)
    def step(x, y):
        loss, pairs = compute(x, y)
        update(pairs)
        return loss

    @tf.function(autograph=False)
    def gradients(x, y):
        loss, pairs = compute(x, y)
        return loss, [g for g, _ in pairs]

    step.model = model
    step.gradients = gradients
    return step


@dataclass
class SplitGraph:
    """The TF1 form of a split step: run ``train_op`` (and ``loss``) feeding ``x`` and ``y``."""

    graph: tf.Graph
    x: tf.Tensor
    y: tf.Tensor
    output: tf.Tensor
    loss: tf.Tensor
    train_op: tf.Operation
    init_op: tf.Operation
    variables: list = field(default_factory=list)  # per part


def build_graph(partition: Partition, loss_fn: Callable, learning_rate: float,
                x_shape: Sequence[int], y_shape: Sequence[int]) -> SplitGraph:
    """The split step as a TF1 graph: variables and ops of each part under ``tf.device``, plain
    SGD with ``colocate_gradients_with_ops=True`` (each gradient op on its forward op's
    device). Run it in ``tf.compat.v1.Session(graph=g.graph, config=session_config())``."""
    lr = checks.positive_number("learning_rate", learning_rate)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, list(x_shape), name="x")
        y = tf.compat.v1.placeholder(tf.float32, list(y_shape), name="y")
        per_part, h = [], x
        for part in partition.parts:
            with tf.device(part.device), tf.compat.v1.variable_scope(f"part_{part.index}"):
                params = [[tf.compat.v1.Variable(a, name=f"layer{j}_w{k}", use_resource=True)
                           for k, a in enumerate(partition.specs[j].arrays)]
                          for j in part.layers]
                h = run_layers([partition.specs[j] for j in part.layers], params, h)
            per_part.append([v for layer in params for v in layer])
        with tf.device(partition.parts[-1].device):
            loss = tf.reduce_mean(loss_fn(y, h), name="loss")
        opt = tf.compat.v1.train.GradientDescentOptimizer(lr)
        train_op = opt.minimize(loss, colocate_gradients_with_ops=True)
        init_op = tf.compat.v1.global_variables_initializer()
    return SplitGraph(graph, x, y, h, loss, train_op, init_op, per_part)


def _mean_over_replicas(grads: list, devices: list[str]) -> list:
    """The replicas' gradients of one variable averaged, one result on each replica's device:
    an all-reduce (mean) for dense gradients; for an embedding's ``IndexedSlices``, every
    replica's rows gathered onto each device, scaled by 1 / replicas (kept sparse, as
    ``model.fit`` on the whole batch gives Keras's optimizer)."""
    if not any(km.is_sparse(g) for g in grads):
        return all_reduce(grads, devices, op="mean")
    out = []
    for device in devices:
        with tf.device(device):
            out.append(km.merge_gradients(grads, [1.0 / len(grads)] * len(grads)))
    return out


class ModelParallel(Form):
    """A Keras ``Sequential`` split over devices (model parallelism), optionally replicated
    (hybrid: data x model parallelism).

    ``ModelParallel(model, devices, loss=..., optimizer=...)`` cuts the layers into
    ``len(devices)`` consecutive parts (``balance``: ``"count"``, ``"bytes"`` or a list of
    layer counts) and trains a working copy of part ``i`` on ``devices[i]``
    (``accel.parallel.keras_model``): only activations cross devices going forward, their
    gradients going back.

    ``replicas=[[devices of replica 0], [devices of replica 1], ...]`` instead of ``devices``:
    every replica holds its own copy of every part on its own devices, trains on its share of
    the batch, and each part's gradients are all-reduced (mean) among the replicas' copies of
    that part (``accel.collectives.all_reduce``, every copy receiving bitwise the same values);
    each replica then applies the same update with its own optimizer, so the replicas' weights
    stay equal without any copy being read from another. Layers with non-trainable state (e.g.
    BatchNormalization) keep it per replica: each normalises its own share and updates its own
    moving statistics; ``write_back`` takes replica 0's.

    * ``train_step(x, y)``: one step as a ``tf.function`` (the user's model untouched);
    * ``gradients(x, y) -> (loss, gradients)``: replica 0's (all-reduced) gradients, in the
      order of its variables, without applying them;
    * ``fit``, ``write_back``: ``accel.parallel.form.Form``'s (with replicas, batches a
      multiple of their number).
    """

    name = "model"
    options = ("balance", "replicas", "split_points")

    def __init__(self, model, devices: Sequence[str] | None = None, *, loss, optimizer,
                 balance="count", replicas: Sequence[Sequence[str]] | None = None,
                 split_points: Sequence[str] | None = None):
        if (devices is None) == (replicas is None):
            raise ValueError("give devices (one per part) or replicas (one device list per "
                             "replica), not both")
        if replicas is None:
            reps = [device_list(devices)]
        else:
            if isinstance(replicas, str) or not replicas:
                raise ValueError(f"replicas must be a list of device lists, got {replicas!r}")
            reps = [device_list(r, f"replica {i}'s devices") for i, r in enumerate(replicas)]
        num_parts = len(reps[0])
        self.replicas = _check_replicas(reps, num_parts)
        device_list([d for devs in self.replicas for d in devs], "the replicas' devices")
        self.model = model
        self.graph = graph.model_graph(model)
        self.layers = [c.layer for c in self.graph.calls]
        self.balance = graph.split_sizes(self.graph, num_parts, split_points, balance)
        self.graph_parts = graph.cut(self.graph, self.balance)
        self.parts = [gp.layers for gp in self.graph_parts]
        self.loss_fn = km.loss_function(loss)
        self.copies, self.optimizers = [], []
        for devs in self.replicas:
            self.copies.append([graph.copy_part(self.graph, gp, d)
                                for gp, d in zip(self.graph_parts, devs, strict=True)])
            self.optimizers.append(self.make_optimizer(optimizer))
        for r, opt in enumerate(self.optimizers):
            # built eagerly: each slot then sits beside its variable (built inside the step's
            # tf.function, Keras would put them all on one device)
            opt.build(self.variables(r))
        self._compute = self._make_compute()
        self._apply_step = tf.function(self._apply, autograph=False)
        self._grads = tf.function(self._compute, autograph=False)

    def variables(self, replica: int = 0, part: int | None = None) -> list:
        """A replica's trainable variables (of one part, or of all in order)."""
        parts = self.copies[replica] if part is None else [self.copies[replica][part]]
        return [w for copies in parts for c in copies for w in c.trainable_weights]

    def _make_compute(self):
        num_parts, reps = len(self.balance), self.replicas
        loss_fn = self.loss_fn

        def one_replica(r, x, y):
            # a part receives a bundle of tensors (the model's inputs, or what the parts before
            # it pass on: skip connections included) and passes one on; each part adds the
            # terms its layers put in model.losses (regularizers, add_loss) to the loss: they
            # are differentiated with the part's own backward
            saved, bundle, total = [], km.bundle(x), []
            for p, gp in enumerate(self.graph_parts):
                with tf.device(reps[r][p]), tf.GradientTape() as tape:
                    if p > 0:
                        tape.watch(km.float_tensors(bundle))
                    out, terms = graph.run_part(gp, self.copies[r][p], bundle)
                    if p == num_parts - 1:
                        out = km.outputs_loss(loss_fn, y, out, terms)
                        extra = None
                    else:
                        extra = km.added_loss(terms)
                saved.append((tape, bundle, out, extra))
                total += [out] if p == num_parts - 1 else [] if extra is None else [extra]
                bundle = out
            grads, upstream = [None] * num_parts, None
            # a LossScaleOptimizer's scale seeds the backward, as fit scales the loss
            scale = km.loss_scale(self.optimizers[r], saved[-1][2].dtype)
            for p in reversed(range(num_parts)):  # each part's backward on its own device
                tape, inp, out, extra = saved[p]
                inp = [] if p == 0 else km.float_tensors(inp)
                sources = [*inp, *self.variables(r, p)]
                with tf.device(reps[r][p]):
                    own = out if upstream is None else extra  # the loss or the part's terms
                    one = None if own is None else tf.ones_like(own)
                    if scale is not None and one is not None:
                        one = one * tf.cast(scale, one.dtype)
                    if upstream is None:  # the last part: out is the loss
                        g = tape.gradient(out, sources, output_gradients=one,
                                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    else:
                        outs = km.float_tensors(out)
                        targets = outs + ([] if extra is None else [extra])
                        seeds = upstream + ([] if extra is None else [one])
                        g = tape.gradient(targets, sources, output_gradients=seeds,
                                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
                upstream, grads[p] = list(g[:len(inp)]), g[len(inp):]
            loss = tf.add_n(total) if len(total) > 1 else total[0]
            return loss, grads

        def compute(x, y):
            shards = split_batch((x, y), len(reps)) if len(reps) > 1 else [(x, y)]
            results = [one_replica(r, xs, ys) for r, (xs, ys) in enumerate(shards)]
            losses = [loss for loss, _ in results]
            grads = [g for _, g in results]  # [replica][part][variable]
            if len(reps) > 1:
                for p in range(num_parts):
                    part_devices = [reps[r][p] for r in range(len(reps))]
                    for k in range(len(grads[0][p])):
                        reduced = _mean_over_replicas([grads[r][p][k] for r in range(len(reps))],
                                                      part_devices)
                        for r in range(len(reps)):
                            grads[r][p] = [*grads[r][p][:k], reduced[r], *grads[r][p][k + 1:]]
            loss = tf.add_n(losses) / float(len(losses))
            return loss, [[g for part in replica for g in part] for replica in grads]

        return compute

    def _apply(self, x, y):
        loss, grads = self._compute(x, y)
        for r, optimizer in enumerate(self.optimizers):
            optimizer.apply_gradients(zip(grads[r], self.variables(r), strict=True))
        return loss

    def _step(self, x, y):
        return self._apply_step(x, y)

    def batch_parts(self) -> int:
        return len(self.replicas)

    def gradients(self, x, y) -> tuple[float, list]:
        """``(loss, replica 0's gradients)`` for the batch, nothing applied: state that the
        training forward updates (BatchNorm's moving statistics) is put back afterwards."""
        state = [w for copies in self.copies for part in copies for c in part
                 for w in c.non_trainable_weights]
        saved = [w.numpy() for w in state]
        loss, grads = self._grads(tf.convert_to_tensor(x), tf.convert_to_tensor(y))
        for w, value in zip(state, saved, strict=True):
            w.assign(value)
        return float(loss), list(grads[0])

    def write_back(self) -> None:
        """Replica 0's weights (trainable and not) into the user's model."""
        for part, copies in zip(self.parts, self.copies[0], strict=True):
            km.write_back(part, copies)

    def working_variables(self) -> list:
        return [w for copies in self.copies for part in copies for c in part for w in c.weights]

    def optimizer_variables(self) -> list:
        return [v for opt in self.optimizers for v in opt.variables]

    def crossings(self) -> list[list[tuple]]:
        """What crosses each cut between parts, per example (``accel.parallel.graph``)."""
        return graph.crossings(self.graph, self.graph_parts)
