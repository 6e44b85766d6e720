"""The four ways to replicate training on a cluster, as TF1 graphs (``tf.compat.v1``).

* **in-graph**: one client builds one graph holding a replica per worker task and runs it;
  ``sync`` averages the replicas' gradients on the ps and applies them with one optimizer,
  ``async`` gives each replica its own update op, run by its own thread of the client.
* **between-graph**: one client process per worker (``python -m accel.distributed.replication
  client``), each with its own graph and session on its own worker, sharing the variables on the
  ps; ``async`` applies each gradient on arrival, ``sync`` goes through
  ``SyncReplicasOptimizer`` (gradient accumulators on the ps, a token queue, the chief's queue
  runner applying the average). Their mini-batches come from a shared ``FIFOQueue`` on the ps,
  filled in order, so the two gradients of one synchronous update are the two halves of one
  global batch, whichever worker computes which.

The model is the caller's: ``model_fn(params, x)`` returns the predictions of the weights
``params`` (the list ``init`` gives the first values of), trained on the mean squared error; the
client processes import it by name, so it must be a top-level function of an importable module.

Every run lives in its own resource container on the ps, emptied afterwards with
``Session.reset``, so one cluster serves many runs. Asynchronous runs count versions (a counter
on the ps, advanced after each update by ``ResourceCountUpTo``, which returns the value before
its own increment under the variable's lock: an ``assign_add`` followed by a read could also see
another worker's increment, and two updates would record the same version), return
``accel.parallel.staleness.UpdateRecord``s and the sum of every gradient they applied (fetched
in the same ``Session.run`` as the update, so it is the value applied): with plain SGD the final
weights must equal ``init - lr * gradient_sum``, which a lost update breaks.
``seconds`` times the training steps only: the between-graph clients set up (session,
``SyncReplicasOptimizer``'s init ops, tokens, queue runner), meet at a barrier (a counter on the
ps), then note the wall clock; the run counts from the first to leave the barrier to the last to
finish (``python -m accel bench cluster`` turns it into examples per second).

``traffic``: every tensor sent between tasks in ONE global batch's worth of steps, read from the
partition graphs TensorFlow executed (``RunOptions(output_partition_graphs=True)`` on each
client's or thread's first step, parsed by ``accel.placement.sends_in``): in-graph sync, the
first step; in-graph async, each thread's first update (the two half batches of the first global
batch); between-graph, each client's first step. Each entry is a ``Sent`` (from task, to task,
bytes, tensor). The chief's ``SyncReplicasOptimizer`` queue runner (taking the average from the
accumulators, applying it, queueing the tokens) is not traced: its ops sit on the ps with the
accumulators, the variables and the token queue. ``update_sizes`` (asynchronous runs): for each
applied update, the largest element of ``lr * gradient``, the size of one update.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field

import numpy as np
import tensorflow as tf

from accel import checks, training
from accel.distributed.cluster import task_device
from accel.parallel.staleness import UpdateRecord
from accel.placement import sends_in
from accel.procs import function_path, load_function, start_python

__all__ = ["MODES", "RunResult", "Sent", "global_batches", "reference_sgd", "single_process",
           "in_graph", "between_graph", "read_params", "client", "sync_replicas_train_op",
           "start_sync_replicas", "link_totals", "KINDS"]

MODES = ("sync", "async")
VERSION_LIMIT = 2**62  # count_up_to's ceiling: never reached
PS = task_device("ps", 0)


@dataclass(frozen=True)
class Sent:
    """One tensor sent from one task to another (a ``_Send`` of an executed partition graph)."""

    source: str  # 'ps:0', 'worker:1', ...
    target: str
    nbytes: int  # 0 for a control edge
    tensor: str
    kind: str = "other"  # 'weights', 'gradients', 'data', 'other' or 'control'


KINDS = ("weights", "gradients", "data", "other")

@dataclass
class RunResult:
    """One replicated run: final parameters (read from the ps), records of applied gradients
    (asynchronous runs), updates applied, the seconds the training steps took, (asynchronous
    runs) the sum of the gradients applied, in float64, and the size of each update; the tensors
    sent between tasks in one global batch's steps (see the module docstring)."""

    kind: str
    params: list[np.ndarray]
    updates: int
    seconds: float
    records: list[UpdateRecord] = field(default_factory=list)
    gradient_sum: list[np.ndarray] | None = None
    traffic: list[Sent] = field(default_factory=list)
    update_sizes: list[float] = field(default_factory=list)


def _task(device: str) -> str:
    """'/job:ps/replica:0/task:1/device:CPU:0' -> 'ps:1'."""
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
    return f"{parts.get('job', '?')}:{parts.get('task', '0')}"


def _traced_run(sess, fetches, feed_dict=None, labels=None):
    """``sess.run(fetches, feed_dict)`` that also returns every tensor the step sent between
    tasks, from the partition graphs it executed. ``labels`` maps tensor names to a kind: a
    parameter's value read on the ps (``weights``, counted only from a ps), a parameter's
    gradient (``gradients``, counted only into a ps), a batch (``data``); anything else is
    ``other``. A fed placeholder reaches its task as ``_recv_<name>_0``, sized by what was fed."""
    opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
    meta = tf.compat.v1.RunMetadata()
    out = sess.run(fetches, feed_dict, options=opts, run_metadata=meta)
    labels, fed = labels or {}, {t.op.name: v for t, v in (feed_dict or {}).items()}
    sent = []
    for t in sends_in(meta.partition_graphs, sess.graph):
        source, target = _task(t.source), _task(t.target)
        if source == target:
            continue
        nbytes, name = t.nbytes, t.tensor
        if feed := re.fullmatch(r"_recv_(.+)_0:0", name):  # a fed placeholder
            name = feed[1] + ":0"
            nbytes = int(np.asarray(fed[feed[1]]).nbytes) if feed[1] in fed else nbytes
        kind = labels.get(name, "other")
        if t.control or "/ctrl" in name:
            kind = "control"
        elif (kind == "weights" and not source.startswith("ps:")) or (
                kind == "gradients" and not target.startswith("ps:")):
            kind = "other"
        sent.append(Sent(source, target, nbytes, name, kind))
    return out, sent


def _labels(graph, params: list, grads: list, data: list) -> dict[str, str]:
    """Tensor name -> kind for ``_traced_run``: every read of a parameter on the ps, the
    parameters' gradients, the batch tensors."""
    handles = {p.handle.name for p in params}
    out = {op.outputs[0].name: "weights" for op in graph.get_operations()
           if op.type == "ReadVariableOp" and op.inputs[0].name in handles}
    out.update({g.name: "gradients" for g in grads})
    out.update({d.name: "data" for d in data})
    return out


def link_totals(traffic: list[Sent]) -> dict[str, tuple[int, int]]:
    """``{kind: (tensors, bytes)}`` for the kinds ``weights`` (parameter values sent from a ps),
    ``gradients`` (sent to a ps), ``data`` and ``other``, in that order; control edges are not
    counted."""
    out = {k: [0, 0] for k in KINDS}
    for x in traffic:
        if not isinstance(x, Sent):
            raise ValueError(f"traffic must hold Sent records, got {x!r}")
        if x.kind == "control":
            continue
        if x.kind not in out:
            raise ValueError(f"unknown kind {x.kind!r}: the kinds are {KINDS} and 'control'")
        out[x.kind][0] += 1
        out[x.kind][1] += x.nbytes
    return {k: (n, b) for k, (n, b) in out.items()}


def global_batches(x: np.ndarray, y: np.ndarray, global_batch: int, steps: int) -> list:
    """``[(x_s, y_s), ...]``: step ``s`` takes rows ``s*global_batch ...`` (wrapping around)."""
    checks.positive_int("global_batch", global_batch)
    checks.positive_int("steps", steps)
    rows = [np.arange(s * global_batch, (s + 1) * global_batch) % len(x) for s in range(steps)]
    return [(x[r], y[r]) for r in rows]


def _loss(model_fn, params, x, y):
    return tf.reduce_mean(training.squared_error(y, model_fn(params, x)))


def _check_model_fn(model_fn) -> None:
    if not callable(model_fn):
        raise ValueError(f"model_fn must be a function model_fn(params, x), got {model_fn!r}")


def reference_sgd(model_fn: Callable, init: list[np.ndarray], batches: list,
                  learning_rate: float) -> list[np.ndarray]:
    """Plain SGD of ``model_fn`` on one device, one step per global batch: what synchronous
    runs must equal."""
    _check_model_fn(model_fn)
    params = [tf.Variable(p) for p in init]
    for xb, yb in batches:
        with tf.GradientTape() as tape:
            loss = _loss(model_fn, params, xb, yb)
        for p, g in zip(params, tape.gradient(loss, params), strict=True):
            p.assign_sub(learning_rate * g)
    return [p.numpy() for p in params]


def single_process(model_fn: Callable, init: list[np.ndarray], batches: list,
                   learning_rate: float) -> RunResult:
    """The baseline: the same TF1 graph and SGD step on the global batch, one local session."""
    _check_model_fn(model_fn)
    with tf.Graph().as_default():
        params = [tf.Variable(p) for p in init]
        xb = tf.compat.v1.placeholder(tf.float32, (None,) + batches[0][0].shape[1:])
        yb = tf.compat.v1.placeholder(tf.float32, (None,) + batches[0][1].shape[1:])
        sgd = tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
        train = sgd.minimize(_loss(model_fn, params, xb, yb))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            start = time.perf_counter()
            for x, y in batches:
                sess.run(train, {xb: x, yb: y})
            seconds = time.perf_counter() - start
            return RunResult("single process", sess.run(params), len(batches), seconds)


def _ps_variables(init: list[np.ndarray]) -> list:
    with tf.device(PS):
        return [tf.Variable(p, name=f"p{i}") for i, p in enumerate(init)]


def _halves(batch: tuple, replicas: int) -> list:
    xb, yb = batch
    if len(xb) % replicas:
        raise ValueError(f"a global batch of {len(xb)} does not split over {replicas} replicas")
    return list(zip(np.split(xb, replicas), np.split(yb, replicas), strict=True))


def read_params(target: str, container: str, init: list[np.ndarray]) -> list[np.ndarray]:
    """The current values of the run's variables on the ps (the shapes come from ``init``)."""
    with tf.Graph().as_default(), tf.compat.v1.container(container):
        params = _ps_variables(init)
        with tf.compat.v1.Session(target, config=_config(["/job:ps"])) as sess:
            return sess.run([p.read_value() for p in params])


def _config(filters: list[str], timeout_s: float = 120.0):
    return tf.compat.v1.ConfigProto(device_filters=filters,
                                    operation_timeout_in_ms=int(timeout_s * 1000))


def in_graph(cluster: dict, mode: str, model_fn: Callable, init: list[np.ndarray],
             batches: list, learning_rate: float, container: str = "in-graph") -> RunResult:
    """One client, one graph, a replica per worker; see the module docstring."""
    checks.one_of("mode", mode, MODES)
    _check_model_fn(model_fn)
    n = len(cluster["worker"])
    target = "grpc://" + cluster["worker"][0]
    with tf.Graph().as_default(), tf.compat.v1.container(container):
        params = _ps_variables(init)
        with tf.device(PS):
            version = tf.Variable(0, dtype=tf.int64, name="version")
        half = [h.shape for h in _halves(batches[0], n)[0]]  # static shapes: bytes are known
        feeds, grads, losses, reads = [], [], [], []
        for w in range(n):
            with tf.device(task_device("worker", w)):
                xw = tf.compat.v1.placeholder(tf.float32, half[0])
                yw = tf.compat.v1.placeholder(tf.float32, half[1])
                reads.append(version.read_value())
                losses.append(_loss(model_fn, params, xw, yw))
                grads.append(tf.gradients(losses[-1], params))
                feeds.append((xw, yw))
        opt = tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
        if mode == "sync":
            with tf.device(PS):
                mean = [tf.add_n(list(g)) / n for g in zip(*grads, strict=True)]
                train = [opt.apply_gradients(zip(mean, params, strict=True))]
        else:
            train = []
            for w in range(n):
                with tf.control_dependencies([reads[w]]):
                    apply = opt.apply_gradients(zip(grads[w], params, strict=True))
                with tf.control_dependencies([apply]):
                    train.append(_next_version(version))
        with tf.compat.v1.Session(target, config=_config(["/job:ps", "/job:worker"])) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            start = time.perf_counter()
            records, sums, traffic, sizes = [], [np.zeros(p.shape) for p in init], [], []
            labels = _labels(sess.graph, params, [g for gs in grads for g in gs],
                             [t for f in feeds for t in f])
            if mode == "sync":
                for s, batch in enumerate(batches):
                    fd = {t: v for f, h in zip(feeds, _halves(batch, n), strict=True)
                          for t, v in zip(f, h, strict=True)}
                    if s == 0:  # the first step traced: what it sent between tasks
                        traffic += _traced_run(sess, train, fd, labels)[1]
                    else:
                        sess.run(train, fd)
            else:
                lock = threading.Lock()

                def loop(w: int) -> None:
                    for s, batch in enumerate(batches):
                        fd = dict(zip(feeds[w], _halves(batch, n)[w], strict=True))
                        fetch = [reads[w], losses[w], train[w], grads[w]]
                        if s == 0:  # each thread's first update traced
                            (read, loss, new, g), sent = _traced_run(sess, fetch, fd, labels)
                        else:
                            (read, loss, new, g), sent = sess.run(fetch, fd), []
                        with lock:
                            traffic.extend(sent)
                            sizes.append(_update_size(learning_rate, g))
                            _accumulate(sums, g)
                            records.append(UpdateRecord(w, int(read), int(new), float(loss),
                                                        time.perf_counter() - start,
                                                        len(fd[feeds[w][0]]), step=s))
                threads = [threading.Thread(target=loop, args=(w,)) for w in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            seconds = time.perf_counter() - start
            values = sess.run([p.read_value() for p in params])
        tf.compat.v1.Session.reset(target, [container])
    updates = len(batches) * (1 if mode == "sync" else n)
    return RunResult(f"in-graph {mode}", values, updates, seconds,
                     sorted(records, key=lambda r: r.applied_version),
                     None if mode == "sync" else sums, traffic, sizes)


def _update_size(learning_rate: float, grads: list[np.ndarray]) -> float:
    """The largest element of ``learning_rate * gradient``: how far one update moves a weight."""
    return float(max(np.max(np.abs(learning_rate * np.asarray(g))) for g in grads))


def _next_version(version):
    """Add 1 to ``version`` and return its value before, in one op under the variable's lock
    (``ResourceCountUpTo``: "the values produced will all be distinct", ``Variable.count_up_to``'s
    docstring, whose deprecation warning the raw op skips)."""
    return tf.raw_ops.ResourceCountUpTo(resource=version.handle, limit=VERSION_LIMIT,
                                        T=version.dtype)


def _accumulate(sums: list[np.ndarray], grads: list[np.ndarray]) -> None:
    for total, g in zip(sums, grads, strict=True):
        total += g


def _data_queue(shapes: list[tuple], capacity: int):
    with tf.device(PS):
        return tf.queue.FIFOQueue(capacity, [tf.int32, tf.float32, tf.float32],
                                  shapes=[(), *shapes], shared_name="data", name="data")


def between_graph(cluster: dict, mode: str, model_fn: Callable, init: list[np.ndarray],
                  batches: list, learning_rate: float, container: str = "between-graph",
                  timeout: float = 180.0) -> RunResult:
    """A client process per worker; see the module docstring. The caller's process only fills
    the data queue on the ps, starts the clients, waits for them and reads the result."""
    checks.one_of("mode", mode, MODES)
    model_path = function_path(model_fn, "model_fn")
    n = len(cluster["worker"])
    target = "grpc://" + cluster["ps"][0]
    items = [(s * n + w, *h) for s, b in enumerate(batches) for w, h in enumerate(_halves(b, n))]
    shapes = [items[0][1].shape, items[0][2].shape]
    with tf.Graph().as_default(), tf.compat.v1.container(container):
        _ps_variables(init)
        with tf.device(PS):
            tf.Variable(0, dtype=tf.int64, name="version")
            tf.Variable(0, dtype=tf.int64, name="arrived")  # the clients' start barrier
            tf.compat.v1.train.create_global_step()
        queue = _data_queue(shapes, len(items))
        fill = queue.enqueue_many([np.array(c) for c in zip(*items, strict=True)])
        with tf.compat.v1.Session(target, config=_config(["/job:ps"])) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(fill)
    spec = {"cluster": cluster, "mode": mode, "container": container,
            "learning_rate": learning_rate, "model_fn": model_path,
            "param_shapes": [list(np.shape(p)) for p in init],
            "shapes": [list(s) for s in shapes], "steps": len(batches)}
    children = [start_python(["-m", "accel.distributed.replication", "client",
                              json.dumps({**spec, "worker": w})], name=f"client of worker:{w}")
                for w in range(n)]
    try:
        reports = []
        for child in children:
            code = child.wait(timeout)
            out, err = child.output()
            if code != 0:
                raise RuntimeError(f"{child.name} failed (exit {code}):\n{err[-1500:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for child in children:
            child.stop()
    values = read_params(target, container, init)
    tf.compat.v1.Session.reset(target, [container])
    records = [UpdateRecord(*r) for rep in reports for r in rep["records"]]
    updates = len(batches) if mode == "sync" else len(items)
    first = min(rep["ready"] for rep in reports)
    sums = None
    if mode == "async":
        sums = [np.zeros(p.shape) for p in init]
        for rep in reports:
            _accumulate(sums, [np.array(g) for g in rep["gradient_sum"]])
    traffic = [Sent(*x) for rep in reports for x in rep["traffic"]]
    return RunResult(f"between-graph {mode}", values, updates,
                     max(rep["done"] for rep in reports) - first,
                     sorted(records, key=lambda r: r.applied_version), sums, traffic,
                     [size for rep in reports for size in rep["update_sizes"]])


def sync_replicas_train_op(grads: list, params: list, learning_rate: float, replicas: int,
                           global_step):
    """Between-graph synchronous SGD, built by every client in its own graph. Returns the
    optimizer and the train op, which puts each gradient into its variable's accumulator on the
    ps and then waits for a token from the chief: the global step the worker computes next."""
    opt = tf.compat.v1.train.SyncReplicasOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
        replicas_to_aggregate=replicas,  # gradients averaged into one update
        total_num_replicas=replicas)  # tokens handed out after each update
    train = opt.apply_gradients(zip(grads, params, strict=True), global_step=global_step)
    opt.ready_for_local_init_op.mark_used()  # read only by its session hook: silences a log
    return opt, train


def start_sync_replicas(sess, opt, chief: bool) -> None:
    """Each client, once, before its first step: its local step from the global step. The chief
    (worker 0) also gives every accumulator the global step and starts the queue runner that,
    whenever ``replicas`` gradients of the current step are in every accumulator, applies their
    average and queues ``replicas`` tokens for the next step."""
    sess.run(opt.chief_init_op if chief else opt.local_step_init_op)
    if chief:
        sess.run(opt.get_init_tokens_op(num_tokens=0))  # none: every worker starts at once
        opt.get_chief_queue_runner().create_threads(sess, tf.train.Coordinator(), daemon=True,
                                                    start=True)


def client(spec: dict) -> dict:
    """One worker's client (run in its own process): build this worker's graph, train, and
    return ``{"ready", "done", "records", "gradient_sum"}``: the wall clock (``time.time``)
    after its set-up and at its end, and (async) its records and the sum of its gradients."""
    cluster, w, mode = spec["cluster"], spec["worker"], spec["mode"]
    n, steps = len(cluster["worker"]), spec["steps"]
    init = [np.zeros(s, np.float32) for s in spec["param_shapes"]]
    model_fn = load_function(spec["model_fn"])
    with tf.Graph().as_default(), tf.compat.v1.container(spec["container"]):
        params = _ps_variables(init)
        with tf.device(PS):
            version = tf.Variable(0, dtype=tf.int64, name="version")
            arrived = tf.Variable(0, dtype=tf.int64, name="arrived")
            arrive, count = arrived.assign_add(1), arrived.read_value()
            step = tf.compat.v1.train.get_or_create_global_step()
        queue = _data_queue([tuple(s) for s in spec["shapes"]], n * steps)
        with tf.device(task_device("worker", w)):
            index, xb, yb = queue.dequeue()
            read = version.read_value()
            loss = _loss(model_fn, params, xb, yb)
            grads = tf.gradients(loss, params)
            opt = tf.compat.v1.train.GradientDescentOptimizer(spec["learning_rate"])
            if mode == "async":
                with tf.control_dependencies([read]):
                    apply = opt.apply_gradients(zip(grads, params, strict=True))
                with tf.control_dependencies([apply]):
                    train = _next_version(version)
            else:
                opt, train = sync_replicas_train_op(grads, params, spec["learning_rate"], n, step)
        with tf.compat.v1.Session("grpc://" + cluster["worker"][w],
                                  config=_config(["/job:ps", task_device("worker", w)])) as sess:
            records, sums, traffic, sizes = [], [np.zeros(p.shape) for p in init], [], []
            labels = _labels(sess.graph, params, grads, [xb, yb])
            if mode == "sync":
                start_sync_replicas(sess, opt, chief=w == 0)
            sess.run(arrive)  # a barrier: the steps start when every client is set up,
            while sess.run(count) < n:  # so no clock counts set-up
                time.sleep(0.002)
            ready = time.time()
            if mode == "async":
                for s in range(steps):
                    fetch = [index, read, loss, train, grads]
                    if s == 0:  # the first step traced: what it sent between tasks
                        (i, r, lv, new, g), traffic = _traced_run(sess, fetch, labels=labels)
                    else:
                        i, r, lv, new, g = sess.run(fetch)
                    _accumulate(sums, g)
                    sizes.append(_update_size(spec["learning_rate"], g))
                    records.append([w, int(r), int(new), float(lv), time.time() - ready,
                                    int(spec["shapes"][0][0]), False, int(i)])
            else:
                token, traffic = _traced_run(sess, train, labels=labels)  # the first step traced
                token = int(token)
                while token < steps:  # the token is the global step this worker works on next
                    token = int(sess.run(train))
            return {"ready": ready, "done": time.time(), "records": records,
                    "gradient_sum": [g.tolist() for g in sums],
                    "traffic": [list(astuple(x)) for x in traffic], "update_sizes": sizes}


if __name__ == "__main__":
    if sys.argv[1:2] != ["client"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m accel.distributed.replication client SPEC_JSON")
    print(json.dumps(client(json.loads(sys.argv[2]))), flush=True)
    sys.stdout.flush()
    import os
    os._exit(0)  # the chief's queue-runner thread blocks on the next take_grad: do not join it
