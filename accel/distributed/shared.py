"""State that outlives a session on a cluster, and where variables go on the ps tasks.

* Resources (variables, queues) live in the *server* process, in a container, under a shared
  name: any session in any process that names them reaches the same object. ``visit`` is a
  second process doing that (``python -m accel.distributed.shared visit SPEC``): it adds to the
  scalar variable ``counter`` on ps:0 and puts numbers into the queue ``mailbox`` there.
* ``ByteSizeStrategy``: a ``ps_strategy`` for ``tf.compat.v1.train.replica_device_setter`` that
  sends each variable to the ps task holding the fewest bytes so far (TF1's
  ``GreedyLoadBalancingStrategy`` with ``byte_size_load_fn``, gone with ``tf.contrib``);
  ``bytes_per_task`` counts what a placed graph puts on each task.
* Independent models on separate tasks, their predictions averaged (an ensemble), in both TF1
  forms: ``in_graph_ensemble`` (one client, one network per worker task, the average built in
  the same graph) and ``between_graph_ensemble`` (a client process per worker
  reading its own input queue and writing to a shared prediction queue; the caller averages).
  A network is ``model_fn(params, x)`` with its own ``params`` (the caller's function; the
  clients import it by name, so a top-level function of an importable module).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from accel import checks
from accel.distributed.cluster import task_device
from accel.procs import function_path, load_function, start_python

__all__ = ["ByteSizeStrategy", "variable_bytes", "bytes_per_task", "visit", "mailbox",
           "in_graph_ensemble", "between_graph_ensemble"]

PS = task_device("ps", 0)


def variable_bytes(op) -> int:
    """Bytes of the variable that ``op`` (``VarHandleOp`` / ``VariableV2``) creates."""
    shape = tf.TensorShape(op.get_attr("shape"))
    if not shape.is_fully_defined():
        raise ValueError(f"variable {op.name} has shape {shape}: its bytes are unknown")
    return shape.num_elements() * tf.as_dtype(op.get_attr("dtype")).size


class ByteSizeStrategy:
    """Greedy load balancing: each variable to the task with the fewest bytes so far."""

    def __init__(self, num_tasks: int) -> None:
        checks.positive_int("num_tasks", num_tasks)
        self.loads = [0] * num_tasks

    def __call__(self, op) -> int:
        task = int(np.argmin(self.loads))
        self.loads[task] += variable_bytes(op)
        return task


def bytes_per_task(graph, job: str = "ps") -> dict[str, int]:
    """``{"/job:ps/task:i": bytes}`` of the variables the graph placed on each task of ``job``."""
    out: dict[str, int] = {}
    for op in graph.get_operations():
        if op.type in ("VarHandleOp", "VariableV2") and f"/job:{job}/" in op.device + "/":
            task = tf.DeviceSpec.from_string(op.device)
            key = task_device(task.job, task.task)
            out[key] = out.get(key, 0) + variable_bytes(op)
    return dict(sorted(out.items()))


def mailbox():
    """The scalar ``counter`` variable and the ``mailbox`` queue on ps:0 (build in a graph)."""
    with tf.device(PS):
        counter = tf.Variable(0, dtype=tf.int64, name="counter")
        queue = tf.queue.FIFOQueue(16, tf.int64, shapes=(), shared_name="mailbox",
                                   name="mailbox")
    return counter, queue


def visit(cluster: dict, container: str, add: int, put: list[int], timeout: float = 120) -> int:
    """From a second process, add ``add`` to ``counter`` and enqueue ``put`` into ``mailbox``
    (both on ps:0, in ``container``); return the counter's value that process saw."""
    spec = {"target": "grpc://" + cluster["ps"][0], "container": container, "add": add,
            "put": list(put)}
    with start_python(["-m", "accel.distributed.shared", "visit", json.dumps(spec)],
                      name="the visiting process") as child:
        if child.wait(timeout) != 0:
            raise RuntimeError(f"the visiting process failed:\n{child.output()[1][-1500:]}")
        return int(child.output()[0].split()[-1])


def _visit(spec: dict) -> int:
    with tf.Graph().as_default(), tf.compat.v1.container(spec["container"]):
        counter, queue = mailbox()
        added = counter.assign_add(spec["add"])
        put = queue.enqueue_many([np.array(spec["put"], np.int64)])
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps/task:0"],
                                          operation_timeout_in_ms=60_000)
        with tf.compat.v1.Session(spec["target"], config=config) as sess:
            sess.run(put)
            return int(sess.run(added))


def in_graph_ensemble(cluster: dict, model_fn: Callable, nets: list[list[np.ndarray]],
                      x: np.ndarray) -> np.ndarray:
    """Average of the networks' predictions ``model_fn(net, x)``, network ``w`` on worker ``w``,
    one graph."""
    if not callable(model_fn):
        raise ValueError(f"model_fn must be a function model_fn(params, x), got {model_fn!r}")
    with tf.Graph().as_default():
        preds = []
        for w, net in enumerate(nets):
            with tf.device(task_device("worker", w % len(cluster["worker"]))):
                preds.append(model_fn([tf.constant(p) for p in net], x))
        with tf.device(PS):
            mean = tf.add_n(preds) / len(preds)
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", "/job:worker"])
        with tf.compat.v1.Session("grpc://" + cluster["worker"][0], config=config) as sess:
            return sess.run(mean)


def _queues(n: int, features: int, outputs: int):
    with tf.device(PS):
        inputs = [tf.queue.FIFOQueue(64, [tf.int64, tf.float32], shapes=[(), (features,)],
                                     shared_name=f"inputs-{w}") for w in range(n)]
        preds = tf.queue.FIFOQueue(128, [tf.int64, tf.int64, tf.float32],
                                   shapes=[(), (), (outputs,)], shared_name="predictions")
    return inputs, preds


def between_graph_ensemble(cluster: dict, model_fn: Callable, nets: list[list[np.ndarray]],
                           x: np.ndarray, container: str = "ensemble", wait_ms: int = 2000,
                           timeout: float = 120) -> tuple[np.ndarray, str]:
    """Each worker's client predicts (``model_fn(net, rows)``) every row of ``x`` it finds in
    its input queue; the caller averages the predictions it dequeues. Returns ``(average,
    error)``: ``error`` names what one more dequeue raised after the last prediction (the
    ``wait_ms`` timeout)."""
    path = function_path(model_fn, "model_fn")
    n = len(nets)
    with tf.Graph().as_default():  # the width of a prediction, from the graph (nothing runs)
        outputs = int(model_fn([tf.constant(p) for p in nets[0]], tf.constant(x[:1])).shape[-1])
    with tf.Graph().as_default(), tf.compat.v1.container(container):
        inputs, preds = _queues(n, x.shape[1], outputs)
        fill = [q.enqueue_many([np.arange(len(x)), x]) for q in inputs]
        close = [q.close() for q in inputs]
        take = preds.dequeue()
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps"],
                                          operation_timeout_in_ms=wait_ms)
        target = "grpc://" + cluster["ps"][0]
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run(fill)
            sess.run(close)  # after the rows: a closed queue still hands out what it holds
            children = [start_python(["-m", "accel.distributed.shared", "predict", json.dumps(
                {"cluster": cluster, "worker": w, "net": [p.tolist() for p in net],
                 "model_fn": path, "container": container, "n": n, "features": x.shape[1],
                 "outputs": outputs})],
                name=f"client of worker:{w}") for w, net in enumerate(nets)]
            try:
                for child in children:
                    if child.wait(timeout) != 0:
                        raise RuntimeError(f"{child.name} failed:\n{child.output()[1][-1500:]}")
            finally:
                for child in children:
                    child.stop()
            total = np.zeros((len(x), outputs), np.float32)
            for _ in range(n * len(x)):
                i, _, p = sess.run(take)
                total[i] += p
            try:
                sess.run(take)
                error = "none"
            except tf.errors.DeadlineExceededError as exc:
                error = type(exc).__name__
        tf.compat.v1.Session.reset(target, [container])
    return total / n, error


def _predict(spec: dict) -> None:
    w, n = spec["worker"], spec["n"]
    net = [np.array(p, np.float32) for p in spec["net"]]
    model_fn = load_function(spec["model_fn"])
    with tf.Graph().as_default(), tf.compat.v1.container(spec["container"]):
        inputs, preds = _queues(n, spec["features"], spec["outputs"])
        with tf.device(task_device("worker", w)):
            i, row = inputs[w].dequeue()
            pred = model_fn(net, row[None, :])[0]
        put = preds.enqueue([i, tf.constant(w, tf.int64), pred])
        config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", task_device("worker", w)],
                                          operation_timeout_in_ms=60_000)
        with tf.compat.v1.Session("grpc://" + spec["cluster"]["worker"][w],
                                  config=config) as sess:
            while True:
                try:
                    sess.run(put)
                except tf.errors.OutOfRangeError:  # closed and empty: every row is done
                    return


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("visit", "predict"):
        raise SystemExit("usage: python -m accel.distributed.shared visit|predict SPEC_JSON")
    spec_ = json.loads(sys.argv[2])
    if sys.argv[1] == "visit":
        print(_visit(spec_), flush=True)
    else:
        _predict(spec_)
    os._exit(0)
