"""Chapter 12's set-up and benchmark: one small regression problem shared by every replicated
run, and ``python -m accel bench cluster`` (start-up of 1 ps + 2 workers, then examples per
second of the four replication combinations against one process running the same graph)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from accel import datasets, models
from accel.distributed import replication as rep
from accel.distributed.cluster import LocalCluster

__all__ = ["problem", "bench", "EXERCISE_SHAPES", "check_round_robin", "check_queue_errors"]

# exercise 1: variables of these shapes (float32) placed by round-robin over 2 ps tasks
EXERCISE_SHAPES = [(1000, 64), (64,), (64, 64), (64,), (64, 1), (1,)]


def problem(steps: int = 6, global_batch: int = 32, sizes: tuple = (8, 16, 1),
            lr: float = 0.05, seed: int = 0) -> dict:
    """``{"model_fn", "init", "batches", "lr", "reference"}``: the MLP (``accel.models.mlp_apply``)
    and its starting weights, one global batch per step, the learning rate, and one device's SGD
    result on those batches."""
    x, y, _ = datasets.regression(256, sizes[0], sizes[-1], seed=seed)
    init = models.mlp_init(list(sizes), seed=seed)
    batches = rep.global_batches(x, y, global_batch, steps)
    return {"model_fn": models.mlp_apply, "init": init, "batches": batches, "lr": lr,
            "reference": rep.reference_sgd(models.mlp_apply, init, batches, lr)}


def bench(device_names: Sequence[str], quick: bool = False) -> dict:
    """``python -m accel bench cluster``: examples per second of each combination (training
    steps only, cluster and client set-up excluded) as ratios to one process, and how the wall
    time
    splits into start-up and training. ``device_names`` is unused: the cluster's tasks are
    processes. ``quick``: a few steps of in-graph sync and between-graph async only."""
    del device_names
    p = problem(steps=5 if quick else 60, global_batch=64 if quick else 256,
                sizes=(8, 16, 1) if quick else (32, 256, 1))
    args = (p["model_fn"], p["init"], p["batches"], p["lr"])
    base = rep.single_process(*args)
    start = time.perf_counter()
    with LocalCluster(ps=1, workers=2) as cluster:
        startup = cluster.startup_seconds
        runs, walls = {}, {}
        for kind, run in (("in-graph", rep.in_graph), ("between-graph", rep.between_graph)):
            for mode in ("sync", "async"):
                if quick and (kind, mode) not in (("in-graph", "sync"), ("between-graph", "async")):
                    continue  # quick: each run function and each update mode once
                t = time.perf_counter()
                runs[f"{kind} {mode}"] = run(cluster.cluster, mode, *args,
                                             container=f"bench-{kind}-{mode}")
                walls[f"{kind} {mode}"] = time.perf_counter() - t
    total = time.perf_counter() - start
    # every run sees each example once (async: two half-batch updates per global batch), so
    # compare examples per second, not updates per second
    examples = len(p["batches"]) * len(p["batches"][0][0])
    base_rate = examples / base.seconds
    print(f"cluster start-up (1 ps + 2 workers, each its own process): {startup:.1f} s")
    print(f"one process: {base_rate:.0f} examples/s (global batch {len(p['batches'][0][0])})")
    print("combination          examples/s  vs one process  updates  training share of its wall")
    ratios = {}
    for name, r in runs.items():
        ratios[name] = base.seconds / r.seconds
        print(f"  {name:20s} {examples / r.seconds:8.0f}   {ratios[name]:6.2f}x        "
              f"{r.updates:5d}    {r.seconds / walls[name]:6.1%}")
    trained = sum(r.seconds for r in runs.values())
    print(f"whole run {total:.1f} s: start-up and set-up (processes, imports, graphs) "
          f"{1 - trained / total:.0%}, training loops {trained / total:.0%}")
    return {"startup_s": startup, "ratios": ratios, "baseline_examples_per_s": base_rate,
            "training_share": trained / total}


def _placed_bytes(strategy=None) -> dict[str, int]:
    import tensorflow as tf

    from accel.distributed.shared import bytes_per_task

    with tf.Graph().as_default() as graph:
        with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
                ps_tasks=2, ps_strategy=strategy)):
            for i, shape in enumerate(EXERCISE_SHAPES):
                tf.Variable(tf.zeros(shape), name=f"v{i}")
    return bytes_per_task(graph)


def check_round_robin(answer) -> str:
    """Exercise 1: bytes that round-robin puts on ps task 0 for ``EXERCISE_SHAPES``."""
    if answer is None:
        return "not yet: set answer to a number of bytes"
    right = _placed_bytes()["/job:ps/task:0"]
    return "right" if answer == right else f"not {answer}: count again (float32 = 4 bytes)"


def check_queue_errors(answer) -> str:
    """Exercise 2: ``(error, left)``: the error class name that ``dequeue_many(3)`` raises on a
    *closed* queue holding two items, and how many items the queue holds after it."""
    if answer is None or answer is ... or None in answer or ... in answer:
        return "not yet: set answer to (an error class name, a number of items)"
    import tensorflow as tf

    with tf.Graph().as_default():
        q = tf.queue.FIFOQueue(4, tf.int32, shapes=())
        with tf.compat.v1.Session() as sess:
            sess.run(q.enqueue_many([[1, 2]]))
            sess.run(q.close())
            try:
                sess.run(q.dequeue_many(3))
                error = "none"
            except tf.errors.OpError as exc:
                error = type(exc).__name__
            seen = (error, int(sess.run(q.size())))
    return "right" if tuple(answer) == seen else f"not {tuple(answer)}: try it"
