"""Chapter 13, section 6: fewer messages and fewer bytes, measured on logical devices.

* ``packing_times``: many small gradients all-reduced by the hand ring, packed into buckets
  (``accel.collectives.packed_all_reduce``) or not;
* ``tf_packing``: the same through TensorFlow's collective all-reduce with
  ``CommunicationOptions(bytes_per_pack=...)``, its all-reduces counted in the traced graph;
* ``fp16_training``: a data-parallel regression with float32 vs float16 gradients;
* ``local_sgd_runs``: local SGD with a sync every ``k`` steps (``accel.parallel.local_sgd``);
* ``summation_errors``: how far a sum of ``n`` gradients drifts when its partial sums are
  kept in float16 or bfloat16 (a ring's hops) or only the inputs are (sums in float32).

Section 7, the order of TensorFlow's packed all-reduces against the backward pass:

* ``pack_step``: a ``tf.function`` whose replicas each run a backward pass and hand their
  gradients to the strategy's collective all-reduce in packs (``CommunicationOptions``);
* ``layer_pack_step``: the same with one pack per layer, made by hand as soon as the layer's
  weight gradients exist, and the backward made to wait for it (a control dependency) before
  it moves to the layer below;
* ``pack_order``: per pack, read from the traced graph: its ``CollectiveReduceV2`` on one
  device, the layers whose gradients it carries, the layers its own data waits for, the
  collective it is chained after (TensorFlow's ordering token), and everything it waits for;
* ``traced_packs``: one executed step read from a profiler trace (``accel.profile.op_runs``):
  when each of that device's collectives ran, against its backward matmuls.

The timings of section 6 are taken in interleaved rounds (every setting once per round, so
that a drift of the shared machine hits all alike): each setting's median over the rounds'
medians, and with ``with_spread=True`` the lowest and highest round median beside it. Each
timed function fetches every reduced tensor: TensorFlow prunes from a function the stateless
ops whose results nobody uses, so a timing that fetched one tensor would count one all-reduce,
not all of them (its own collective ops are stateful and always run).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from accel import checks, collectives, datasets, profile, timing
from accel.course.collectives import tf_strategy

__all__ = ["packing_times", "tf_packing", "interleaved_spread", "fp16_training",
           "local_sgd_runs", "SUMMATIONS", "summation_errors", "pack_step", "layer_pack_step",
           "Pack", "pack_order", "traced_packs"]


def _gradient_like(device_names, tensors_per_device, size, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for d in device_names:
        with tf.device(d):
            out.append([tf.constant(rng.standard_normal(size).astype(np.float32))
                        for _ in range(tensors_per_device)])
    return out


def interleaved_spread(fns: dict, rounds: int = 3, repeat: int = 3, warmup: int = 1) -> dict:
    """``{key: (median, lowest, highest)}`` seconds of each zero-argument function of ``fns``,
    timed in ``rounds`` interleaved rounds of ``repeat`` calls each after ``warmup`` untimed
    calls: the median, lowest and highest of the rounds' medians."""
    rounds = checks.positive_int("rounds", rounds)
    repeat = checks.positive_int("repeat", repeat)
    medians: dict = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            medians[k].append(timing.time_fn(fn, repeat, warmup=0))
    return {k: (float(np.median(m)), min(m), max(m)) for k, m in medians.items()}


def _timed(fns: dict, calls: dict, repeat: int, rounds: int, with_spread: bool) -> dict:
    spread = interleaved_spread(fns, rounds, repeat)
    return {k: (spread[k][0], calls[k], spread[k][1:]) if with_spread else (spread[k][0], calls[k])
            for k in fns}


def packing_times(device_names: Sequence[str], tensors: int = 64, size: int = 256,
                  pack_bytes: Sequence[int] = (0, 16 * 1024, 1 << 30), repeat: int = 5,
                  rounds: int = 1, with_spread: bool = False) -> dict:
    """``tensors`` small float32 gradients of ``size`` numbers on each device, all-reduced
    (ring) with each ``pack_bytes``: ``{pack_bytes: (median seconds, number of all-reduces)}``,
    timed in ``rounds`` interleaved rounds of ``repeat`` calls (``with_spread=True`` adds the
    lowest and highest round median as a third element). The timed function returns every
    reduced tensor's sum (the module's note on pruning)."""
    devs = list(device_names)
    grads = _gradient_like(devs, tensors, size)
    fns, calls = {}, {}
    for pack in pack_bytes:
        fn = tf.function(lambda g, pack=pack: [
            tf.stack([tf.reduce_sum(t) for t in ys])
            for ys in collectives.packed_all_reduce(g, devs, pack, "ring")[0]], autograph=False)
        calls[pack] = len(collectives.pack_buckets([4 * size] * tensors, pack))
        fns[pack] = lambda fn=fn: [v.numpy() for v in fn(grads)]
    return _timed(fns, calls, repeat, rounds, with_spread)


def tf_packing(device_names: Sequence[str], tensors: int = 64, size: int = 256,
               bytes_per_pack: Sequence[int] = (1, 16 * 1024, 0), repeat: int = 5,
               rounds: int = 1, with_spread: bool = False) -> dict:
    """TensorFlow's own packing: ``tensors`` float32 gradients of ``size`` numbers on each
    device, summed in a ``tf.function`` by the collective cross-device ops of a
    ``MirroredStrategy`` (``extended.batch_reduce_to``) with
    ``CommunicationOptions(bytes_per_pack=p)`` for each ``p``. Returns ``{p: (median seconds,
    all-reduces per device)}`` (timed as ``packing_times`` times), the count read from the
    traced graph (its ``CollectiveReduce*`` ops over the number of devices). Raises
    ``RuntimeError`` if a sum differs from NumPy's."""
    devs = list(device_names)
    grads = _gradient_like(devs, tensors, size)
    strategy = tf_strategy(tuple(collectives.check_devices(devs)), "collective")
    values = [strategy.experimental_distribute_values_from_function(
        lambda ctx, k=k: grads[ctx.replica_id_in_sync_group][k]) for k in range(tensors)]
    exact = np.sum([[g.numpy() for g in per_device] for per_device in grads], axis=0)
    fns, calls = {}, {}
    for pack in bytes_per_pack:
        options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack)
        fn = tf.function(lambda options=options: [
            strategy.experimental_local_results(r)[0] for r in strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, [(v, v) for v in values], options=options)],
            autograph=False)
        ops = fn.get_concrete_function().graph.get_operations()
        calls[pack] = sum(op.type.startswith("CollectiveReduce") for op in ops) // len(devs)
        if not np.allclose([v.numpy() for v in fn()], exact, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"bytes_per_pack={pack}: the sums differ from NumPy's")
        fns[pack] = lambda fn=fn: [v.numpy() for v in fn()]
    return _timed(fns, calls, repeat, rounds, with_spread)


def fp16_training(device_names: Sequence[str], steps: int = 30, lr: float = 0.1,
                  seed: int = 0) -> dict:
    """A linear regression trained data-parallel over the devices (each its quarter of the
    batch, gradients all-reduced by ring) with the gradients sent as float32 and as float16:
    ``{"float32": [losses], "float16": [losses]}``."""
    devs = list(device_names)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64 * len(devs), 16)).astype(np.float32)
    y = x @ rng.standard_normal((16, 1)).astype(np.float32) + 0.1
    out = {}
    for name, send in (("float32", lambda g: collectives.all_reduce(g, devs, "ring", "mean")),
                       ("float16", lambda g: [v / len(devs) for v in
                                              collectives.compressed_all_reduce(g, devs)])):
        w = np.zeros((16, 1), np.float32)
        losses = []
        for _ in range(steps):
            grads = []
            for xs, ys, d in zip(np.split(x, len(devs)), np.split(y, len(devs)), devs,
                                 strict=True):
                with tf.device(d):
                    grads.append(tf.constant(2 * xs.T @ (xs @ w - ys) / len(xs)))
            g = send(grads)[0].numpy()
            w = w - lr * g
            losses.append(float(np.mean((x @ w - y) ** 2)))
        out[name] = losses
    return out


def local_sgd_runs(device_names: Sequence[str], everys: Sequence[int] = (1, 2, 4, 8),
                   steps: int = 16, lr: float = 0.05, seed: int = 0) -> dict:
    """Local SGD on a linear regression, one shard of 16 examples per device and step, for each
    ``every``: ``{every: LocalSGDResult}`` (same examples, same steps; only the syncs differ)."""
    from accel.parallel.local_sgd import local_sgd
    from accel.training import squared_error

    devs = list(device_names)
    n, b = len(devs), 16
    x, y, _ = datasets.regression(n * b * steps, 8, 4, seed=seed)
    shards = [[(x[(n * t + i) * b:(n * t + i + 1) * b], y[(n * t + i) * b:(n * t + i + 1) * b])
               for t in range(steps)] for i in range(n)]
    params = [np.zeros((8, 4), np.float32), np.zeros(4, np.float32)]
    return {k: local_sgd(lambda p, xb: xb @ p[0] + p[1], squared_error, params, shards, devs,
                         every=k, steps=steps, learning_rate=lr, x_eval=x, y_eval=y)
            for k in everys}


SUMMATIONS = ("float32", "bfloat16 sent, float32 sums", "bfloat16 sums", "float16 sums")


def summation_errors(ns: Sequence[int] = (2, 4, 8, 16, 32, 64), count: int = 4096,
                     seed: int = 0) -> dict[str, list[float]]:
    """The sum of ``n`` gradients (``count`` standard normal float32 numbers each, the first
    ``n`` of one draw) added one after another, as a ring's reduce-scatter adds them, in each
    of ``SUMMATIONS``: ``"float32"`` (every partial sum float32); ``"bfloat16 sent, float32
    sums"`` (each gradient rounded to bfloat16 once, as sent, the sums kept in float32: what a
    receiver that adds the raw contributions itself gets); ``"bfloat16 sums"`` and ``"float16
    sums"`` (each gradient and every partial sum in that type: a ring whose partial sums travel
    in it). Returns ``{summation: [relative error for each n]}``, the error the root mean
    square over the elements of (sum - exact) over that of the exact sum (float64's sum of the
    float32 gradients). TensorFlow's casts and additions."""
    ns = [checks.positive_int("n", n) for n in ns]
    count = checks.positive_int("count", count)
    if not ns:
        raise ValueError("ns is empty: give at least one number of gradients")
    grads = np.random.default_rng(seed).standard_normal((max(ns), count)).astype(np.float32)
    g = tf.constant(grads)
    low = {"bfloat16 sums": tf.bfloat16, "float16 sums": tf.float16}
    out: dict[str, list[float]] = {name: [] for name in SUMMATIONS}
    for n in ns:
        exact = grads[:n].astype(np.float64).sum(axis=0)
        for name in SUMMATIONS:
            if name in low:
                acc = tf.cast(g[0], low[name])
                for i in range(1, n):
                    acc = acc + tf.cast(g[i], low[name])
            else:
                sent = g if name == "float32" else tf.cast(tf.cast(g, tf.bfloat16), tf.float32)
                acc = sent[0]
                for i in range(1, n):
                    acc = acc + sent[i]
            err = tf.cast(acc, tf.float64).numpy() - exact
            out[name].append(float(np.sqrt(np.mean(err ** 2) / np.mean(exact ** 2))))
    return out


def pack_step(strategy, model, x, y, bytes_per_pack: int, reverse: bool = False):
    """A ``tf.function`` (no arguments): every replica of ``strategy`` runs ``model`` on
    ``(x, y)`` (mean squared error) and its backward pass, and hands the gradients to the
    strategy's all-reduce (``ReplicaContext.all_reduce``, sum) with
    ``CommunicationOptions(bytes_per_pack=bytes_per_pack)``: in ``model.trainable_variables``'
    order (first layer first), or last layer first with ``reverse=True``. Nothing is applied."""
    bytes_per_pack = checks.non_negative_int("bytes_per_pack", bytes_per_pack)
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    variables = model.trainable_variables

    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, variables)
        if reverse:
            grads = grads[::-1]
        return tf.distribute.get_replica_context().all_reduce("sum", grads, options=options)

    return tf.function(lambda: strategy.run(replica, (x, y)), autograph=False)


def layer_pack_step(strategy, model, x, y):
    """A ``tf.function`` (no arguments) like ``pack_step``'s, with the order forced by hand: each
    replica records every layer on a tape of its own, then runs the backward one layer at a time
    from the last, makes that layer's pack at once (its weight gradients flattened and
    concatenated, ``pack/<layer>/concat``) and hands it to the strategy's all-reduce (one
    ``ReplicaContext.all_reduce`` per layer, so one collective each, chained in this order by
    TensorFlow's ordering token); the input gradient for the layer below is made under a control
    dependency on that pack, so the backward goes on only once the pack exists. Returns each
    replica's summed packs, last layer first. Nothing is applied."""
    layers = model.layers
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=0)

    def replica(x, y):
        context = tf.distribute.get_replica_context()
        h, tapes = x, []
        for layer in layers:
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(h)
                out = layer(h)
            tapes.append((tape, h, out))
            h = out
        with tf.GradientTape() as tape:
            tape.watch(h)
            loss = tf.reduce_mean((h - y) ** 2)
        upstream = tape.gradient(loss, h)
        summed = []
        for k in reversed(range(len(layers))):
            tape, h_in, h_out = tapes[k]
            weights = tape.gradient(h_out, layers[k].trainable_variables,
                                    output_gradients=upstream)
            with tf.name_scope("pack"), tf.name_scope(layers[k].name):
                pack = tf.concat([tf.reshape(g, [-1]) for g in weights], 0, name="concat")
            summed.append(context.all_reduce("sum", pack, options=options))
            if k:
                with tf.control_dependencies([pack]):
                    upstream = tape.gradient(h_out, h_in, output_gradients=upstream)
        return summed

    return tf.function(lambda: strategy.run(replica, (x, y)), autograph=False)


@dataclass(frozen=True)
class Pack:
    """One pack's all-reduce on one device, read from the traced graph: ``op`` (its
    ``CollectiveReduceV2``), ``data`` (the op that concatenates the pack's gradients, its
    input), ``holds`` (the layers whose gradients it carries), ``needs`` (the layers whose
    weight gradient its own data waits for), ``after`` (the collective it has a control edge
    from, or ``None``), ``waits`` (the layers whose weight gradient it waits for through its
    data or that chain) and ``gates`` (the layers whose backward ops wait for the pack's data
    through a control edge: ``layer_pack_step``'s forced order; empty for ``pack_step``)."""

    op: str
    data: str
    holds: tuple[str, ...]
    needs: tuple[str, ...]
    after: str | None
    waits: tuple[str, ...]
    gates: tuple[str, ...] = ()


_LAYER = re.compile(r"/(d\d+|out)(?:_\d+)?/")


def _layer(name: str) -> str | None:
    found = _LAYER.search(name)
    return found.group(1) if found else None


def _on(op_device: str, device: str) -> bool:
    a, b = tf.DeviceSpec.from_string(op_device), tf.DeviceSpec.from_string(device)
    return (a.device_type, a.device_index) == (b.device_type, b.device_index)


def _weight_grads(ops, control: bool) -> set[str]:
    """Layers whose weight-gradient ``MatMul`` (``inputs^T @ upstream``: ``transpose_a``) is
    among the ancestors of ``ops`` (through data inputs, and control inputs if ``control``)."""
    seen, todo = {}, list(ops)
    while todo:
        op = todo.pop()
        for parent in [t.op for t in op.inputs] + (list(op.control_inputs) if control else []):
            if parent.name not in seen:
                seen[parent.name] = parent
                todo.append(parent)
    return {_layer(name) for name, op in seen.items() if name.startswith("gradient_tape/")
            and op.type == "MatMul" and op.get_attr("transpose_a")} - {None}


def pack_order(step, model, device: str) -> list[Pack]:
    """The packs of ``step`` (a ``pack_step`` or ``layer_pack_step``) on ``device`` (one
    replica's device), in the
    order TensorFlow created their ``CollectiveReduceV2`` ops, read from its traced graph;
    layer names are ``model``'s (``d0``, ``d1``, ..., ``out``). Raises ``ValueError`` if the
    graph holds no collective on ``device``."""
    graph = step.get_concrete_function().graph
    order = [layer.name for layer in model.layers]
    everything = graph.get_operations()
    ops = [op for op in everything
           if op.type == "CollectiveReduceV2" and _on(op.device, device)]
    if not ops:
        raise ValueError(f"no CollectiveReduceV2 on {device!r} in the traced step")
    names = {op.name for op in ops}
    packs = []
    for op in ops:
        data = op.inputs[0].op
        while data.type in ("Identity", "Reshape"):  # a pack of one tensor: TF only reshapes it
            data = data.inputs[0].op
        sources = [t.op.inputs[0].op if t.op.type == "Reshape" else t.op for t in data.inputs]
        held = {_layer(s.name) for s in sources} - {None}
        after = [c.name for c in op.control_inputs if c.name in names]
        gated = {_layer(o.name) for o in everything if data in o.control_inputs} - {None}
        packs.append(Pack(op.name, data.name, tuple(n for n in order if n in held),
                          tuple(n for n in order if n in _weight_grads([data], False)),
                          after[0] if after else None,
                          tuple(n for n in order if n in _weight_grads([op], True)),
                          tuple(n for n in order if n in gated)))
    return packs


def traced_packs(step, packs: Sequence[Pack], device: str, logdir: str | None = None) -> dict:
    """One executed run of ``step`` (run once before, so that nothing is traced or set up
    inside the trace) read from a profiler trace (``accel.profile.read_trace``, kept under
    ``logdir`` if given), on ``device``'s ops: ``runs`` (per pack, in
    ``packs``' order: when its data was ready, when its collective started and when it ended,
    ms from the trace's first op), ``backward_end`` (when the device's last backward ``MatMul``
    ended), ``in_order`` (whether the collectives started in ``packs``' order) and
    ``made_before_end`` and ``started_before_end`` (how many packs' data were made, and how many
    collectives started, before that last matmul ended), ``made_order`` (the packs' indices in
    the order their data were made) and ``intervals`` for ``accel.viz.timeline``: the device's
    input-gradient and weight-gradient matmuls (two lanes, labelled by layer), the ops that
    concatenate each pack's gradients (``p0``, ``p1``, ...) and its collectives (``c0``,
    ``c1``, ...)."""
    graph = step.get_concrete_function().graph
    backward = {op.name: op.get_attr("transpose_a") for op in graph.get_operations()
                if op.type == "MatMul" and op.name.startswith("gradient_tape/")
                and _on(op.device, device)}
    step()
    for _ in range(3):  # one loaded suite run's trace held no run of one collective (never seen
        # alone): the results are fetched inside the trace, and a trace missing an op is retaken
        runs = profile.read_trace(
            lambda: [t.numpy() for t in tf.nest.flatten(step(), expand_composites=True)],
            profile.op_runs, logdir)
        found = {r.name: r for r in runs}
        missing = [name for p in packs for name in (p.op, p.data) if name not in found]
        if not missing:
            break
    if missing:
        raise ValueError(f"the trace holds no run of {missing}")
    mine = [(found[p.data].end, found[p.op].start, found[p.op].end) for p in packs]
    matmuls = [r for r in runs if r.name in backward]
    if not matmuls:
        raise ValueError(f"the trace holds no backward MatMul on {device!r}")
    intervals = [("weight gradients" if backward[r.name] else "input gradients", r.start, r.end,
                  _layer(r.name) or "?") for r in matmuls]
    intervals += [("pack data", found[p.data].start, found[p.data].end, f"p{k}")
                  for k, p in enumerate(packs)]
    intervals += [("collectives", s, e, f"c{k}") for k, (_, s, e) in enumerate(mine)]
    lanes = ("input gradients", "weight gradients", "pack data", "collectives")
    intervals.sort(key=lambda i: (lanes.index(i[0]), i[1]))
    starts = [s for _, s, _ in mine]
    end = max(r.end for r in matmuls)
    return {"runs": mine, "backward_end": end, "in_order": starts == sorted(starts),
            "made_before_end": sum(ready < end for ready, _, _ in mine),
            "started_before_end": sum(start < end for start in starts),
            "made_order": sorted(range(len(mine)), key=lambda k: mine[k][0]),
            "intervals": intervals}
