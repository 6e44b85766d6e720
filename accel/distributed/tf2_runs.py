"""Then and now: TF2's strategies running the same model as ``accel.distributed.replication``.

* ``ParameterServerStrategy`` + ``ClusterCoordinator`` (asynchronous training under central
  coordination: ONE client, the coordinator, dispatches functions to the workers; not a client
  per worker as in between-graph replication): ``coordinated_run`` starts the coordinator as its
  own process (it takes the cluster's ``chief`` task), which schedules one ``tf.function`` per
  step onto whichever worker is free; the variables live on the ps, counters there count the
  updates applied and the functions that ran to their end. Every function, once its update is on
  the ps, waits at a gate (a queue on the ps) before it ends (``gated_step``); the gate opens
  once every function is scheduled (``schedule_and_join``). With ``kill_mid_step=True`` it opens
  only when every worker holds such a function and the caller has killed the last worker. The
  coordinator runs the killed worker's function again on a live worker (at-least-once), so its
  update lands twice: the ps counts one update more than the functions scheduled.
* ``MultiWorkerMirroredStrategy`` (between-graph synchronous, all-reduce, no ps):
  ``mirrored_run`` starts one process per worker with only ``TF_CONFIG`` set; each takes its
  slice of every global batch and runs ``mirrored_step``.

The model is the caller's ``model_fn(params, x)`` (predictions), trained on the squared error
as in ``accel.distributed.replication``; the processes import it by name, so it must be a
top-level function of an importable module.

Keras 3's ``fit`` does not run under either strategy; both runs are custom loops (chapter 14
runs ``accel.parallel.strategies.train_loop`` under both instead).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from accel import training
from accel.distributed.cluster import LocalCluster, make_cluster, parse_tf_config, tf_config
from accel.procs import (
    ChildFailed,
    function_path,
    load_function,
    report_and_linger,
    start_python,
    wait_for_reports,
)

__all__ = ["coordinated_run", "mirrored_run", "coordinator_setup", "gated_step",
           "schedule_and_join", "mirrored_step", "mirrored_worker"]

IN_FLIGHT = "in flight: "  # the coordinator's line that asks the caller to kill a worker now


def _spec(model_fn, init, batches, learning_rate) -> dict:
    return {"model_fn": function_path(model_fn, "model_fn"), "init": [p.tolist() for p in init],
            "x": [b[0].tolist() for b in batches], "y": [b[1].tolist() for b in batches],
            "learning_rate": learning_rate}


def _wait_json(child, timeout: float, progress=None) -> dict:
    """Wait for ``child``; call ``progress(stdout)`` while it runs; return its last JSON line."""
    end = time.monotonic() + timeout
    while child.alive():
        if time.monotonic() > end:
            child.stop()
            raise ChildFailed(f"{child.name} ran past its {timeout:g} s timeout and was stopped")
        if progress is not None:
            progress(child.output()[0])
        time.sleep(0.05)
    out, err = child.output()
    if child.popen.returncode != 0:
        raise ChildFailed(f"{child.name} failed (exit {child.popen.returncode}):\n{err[-1500:]}")
    return json.loads(out.strip().splitlines()[-1])


def _spec_file(spec: dict) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    return f.name


def coordinated_run(cluster: LocalCluster, model_fn: Callable, init: list[np.ndarray],
                    batches: list, learning_rate: float, kill_mid_step: bool = False,
                    timeout: float = 240.0) -> dict:
    """Train ``model_fn`` with ``ParameterServerStrategy`` on ``cluster`` (its ``chief`` task
    left to the coordinator process), one function per global batch. Returns ``{"params", "devices",
    "scheduled", "applied", "finished", "killed", "at_kill"}``: the device of each weight (the
    strategy deals them to the ps tasks round-robin), updates the ps applied, functions that ran
    to their end, and (with ``kill_mid_step``) the same counts when the last worker was killed."""
    if "chief" not in cluster.cluster or ("chief", 0) not in cluster.skip:
        raise ValueError("the cluster needs a chief task that it does not start itself "
                         "(LocalCluster(chief=True, skip=[('chief', 0)])): the coordinator")
    victim = len(cluster.cluster["worker"]) - 1
    path = _spec_file({**_spec(model_fn, init, batches, learning_rate),
                       "kill": bool(kill_mid_step),
                       "victim": cluster.cluster["worker"][victim]})
    child = start_python(["-m", "accel.distributed.tf2_runs", "coordinator", path],
                         env={"TF_CONFIG": tf_config(cluster.cluster, "chief", 0)},
                         name="the coordinator (chief:0)")
    killed, at_kill = [], {}

    def progress(out: str) -> None:
        if kill_mid_step and not killed and IN_FLIGHT in out:
            line = next(ln for ln in out.splitlines() if ln.startswith(IN_FLIGHT))
            at_kill.update(json.loads(line[len(IN_FLIGHT):]))
            cluster.kill("worker", victim)
            killed.append(victim)

    try:
        report = _wait_json(child, timeout, progress)
    finally:
        child.stop()
        os.unlink(path)
    report["params"] = [np.array(p, np.float32) for p in report["params"]]
    return {**report, "killed": [("worker", k) for k in killed], "at_kill": at_kill}


def mirrored_run(model_fn: Callable, init: list[np.ndarray], batches: list,
                 learning_rate: float, workers: int = 2, host: str = "127.0.0.1",
                 timeout: float = 240.0) -> list[list[np.ndarray]]:
    """Train ``model_fn`` with ``MultiWorkerMirroredStrategy`` in ``workers`` processes started
    with only ``TF_CONFIG``; returns each worker's final weights."""
    spec = _spec(model_fn, init, batches, learning_rate)
    cluster = make_cluster(ps=0, workers=workers, host=host)
    path = _spec_file(spec)
    children = [start_python(["-m", "accel.distributed.tf2_runs", "mirrored", path],
                             env={"TF_CONFIG": tf_config(cluster, "worker", w)},
                             name=f"worker:{w}") for w in range(workers)]
    try:
        reports = wait_for_reports(children, timeout)
    finally:
        for c in children:
            c.stop()
        os.unlink(path)
    return [[np.array(p, np.float32) for p in r["params"]] for r in reports]


def gated_step(params, applied, finished, gate, xs, ys, model_fn, learning_rate):
    """The function the coordinator schedules once per global batch ``s``: SGD on the ps's
    weights, counted there, then a wait at ``gate`` (a queue on the ps) before it counts as
    finished. ``tf.function``'s automatic control dependencies add no edge between ops on
    different resources, so the order (weights, then the counter, then the gate) is made
    explicit with control dependencies. The
    token passes through the worker, so a function cut off with its worker never counts."""

    @tf.function
    def step(s):
        xb, yb = tf.gather(xs, s), tf.gather(ys, s)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(training.squared_error(yb, model_fn(params, xb)))
        updates = [v.assign_sub(learning_rate * g)  # the update, on the ps
                   for v, g in zip(params, tape.gradient(loss, params), strict=True)]
        with tf.control_dependencies(updates):  # counted only once every weight is updated
            counted = applied.assign_add(1)
        with tf.control_dependencies([counted]):  # the gate only after that
            token = tf.identity(gate.dequeue())
        finished.assign_add(token * 0 + 1)  # only a function that got past it counts
    return step


def schedule_and_join(coordinator, step, steps: int, gate, tokens: int, in_flight=None) -> None:
    """The coordinator's loop: queue one ``step`` per global batch for whichever worker is free,
    let ``in_flight()`` act while they hold their functions (here: kill a worker), open the
    gate, and wait until every function has ended, those retried on another worker included."""
    for s in range(steps):
        coordinator.schedule(step, args=(tf.constant(s),))  # returns at once
    if in_flight is not None:
        in_flight()
    gate.enqueue_many(tf.zeros(tokens, tf.int64))  # open the gate
    coordinator.join()  # raises if a ps is lost; a lost worker's functions run elsewhere


def coordinator_setup(cluster: dict, init: list) -> tuple:
    """The coordinator's side of ``ParameterServerStrategy``, in the chief's process: the
    strategy over ``cluster`` (a ``{job: [address, ...]}`` dict), its ``ClusterCoordinator``, and
    the weights (from ``init``) and two counters, made in ``strategy.scope()`` so that the
    strategy places them on the ps tasks. Returns ``(coordinator, params, applied, finished)``."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), rpc_layer="grpc", task_type="chief", task_id=0)
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():  # variables made here live on the ps, round-robin
        params = [tf.Variable(np.array(p, np.float32)) for p in init]
        applied = tf.Variable(0, dtype=tf.int64)
        finished = tf.Variable(0, dtype=tf.int64)
    return coordinator, params, applied, finished


def _coordinator(spec: dict) -> dict:
    cluster, _, _ = parse_tf_config(os.environ["TF_CONFIG"])
    coordinator, params, applied, finished = coordinator_setup(cluster, spec["init"])
    xs, ys = np.array(spec["x"], np.float32), np.array(spec["y"], np.float32)
    steps, workers, kill = len(xs), len(cluster["worker"]), spec.get("kill", False)
    tokens = 2 * steps + workers + 2  # enough for every function, retries included
    with tf.device("/job:ps/task:0"):
        gate = tf.queue.FIFOQueue(tokens, tf.int64, shapes=(), shared_name="gate")
    step = gated_step(params, applied, finished, gate, xs, ys, load_function(spec["model_fn"]),
                      spec["learning_rate"])

    def kill_one() -> None:
        end = time.monotonic() + 120
        while applied.numpy() < workers:  # each worker holds a function that updated the ps
            if time.monotonic() > end:
                raise RuntimeError("the workers did not start their first functions in 120 s")
            time.sleep(0.05)
        counts = {"scheduled": steps, "applied": int(applied.numpy()),
                  "finished": int(finished.numpy())}
        print(IN_FLIGHT + json.dumps(counts), flush=True)  # the caller kills a worker now
        host, port = spec["victim"].rsplit(":", 1)
        end = time.monotonic() + 60
        while time.monotonic() < end and _listening(host, int(port)):
            time.sleep(0.05)

    schedule_and_join(coordinator, step, steps, gate, tokens, kill_one if kill else None)
    return {"params": [p.numpy().tolist() for p in params], "scheduled": steps,
            "applied": int(applied.numpy()), "finished": int(finished.numpy()),
            "devices": [p.device for p in params]}


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def mirrored_step(strategy, params, model_fn, learning_rate):
    """One synchronous step under ``MultiWorkerMirroredStrategy``, run by every worker on its
    slice of the global batch: each replica's gradient, summed over every replica of every
    worker by an all-reduce, applied by each worker to its own copy of the weights."""

    @tf.function
    def step(xb, yb, global_batch):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(training.squared_error(yb, model_fn(params, xb)))
                loss = loss / global_batch  # the mean over the GLOBAL batch
            grads = tf.distribute.get_replica_context().all_reduce(
                "sum", tape.gradient(loss, params))  # the same sum on every worker
            for v, g in zip(params, grads, strict=True):
                v.assign_sub(learning_rate * g)  # each worker updates its own copy
        strategy.run(replica, (xb, yb))
    return step


def mirrored_worker(spec: dict) -> dict:
    """What each worker process runs under ``MultiWorkerMirroredStrategy``: the strategy (from
    ``TF_CONFIG``; it starts this task's server and joins the others), its copy of the weights,
    made in ``strategy.scope()``, then ``mirrored_step`` on this worker's slice of every global
    batch. ``spec``: the problem ``mirrored_run`` writes. Returns the final weights."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    _, _, index = parse_tf_config(os.environ["TF_CONFIG"])
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        params = [tf.Variable(np.array(p, np.float32)) for p in spec["init"]]
    step = mirrored_step(strategy, params, load_function(spec["model_fn"]),
                         spec["learning_rate"])
    for xb, yb in zip(spec["x"], spec["y"], strict=True):
        xb, yb = np.array(xb, np.float32), np.array(yb, np.float32)
        part = len(xb) // n
        step(xb[index * part:(index + 1) * part], yb[index * part:(index + 1) * part],
             float(len(xb)))
    return {"params": [p.numpy().tolist() for p in params]}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("coordinator", "mirrored"):
        raise SystemExit("usage: python -m accel.distributed.tf2_runs coordinator|mirrored SPEC")
    with open(sys.argv[2]) as f:
        spec = json.load(f)
    if sys.argv[1] == "mirrored":  # ends with the other workers (see report_and_linger)
        report_and_linger(mirrored_worker(spec))
    print(json.dumps(_coordinator(spec)), flush=True)
    os._exit(0)  # the coordinator's threads would keep a finished process alive
