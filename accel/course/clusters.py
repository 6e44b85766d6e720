"""Chapter 12's set-up, benchmark and exercises: one small regression problem shared by every
replicated run; ``python -m accel bench cluster`` (start-up of 1 ps + 2 workers, then examples
per second of the four replication combinations against one process running the same graph);
the checks of exercise 1 (which step updates a retried function leaves wrong: each update run
once and twice) and exercise 2 (bytes per link per synchronous step, parameter servers vs a ring
all-reduce, counted message by message by ``link_bytes``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from accel import datasets, models
from accel.distributed import replication as rep
from accel.distributed.cluster import LocalCluster

__all__ = ["problem", "bench", "STEP_UPDATES", "not_idempotent", "check_idempotent", "link_bytes",
           "BANDWIDTH_WORKERS", "BANDWIDTH_BYTES", "check_bandwidth"]


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


# Exercise 1: what a step function may do to state on the ps; which of these leave a different
# state when the same call runs twice (a retried function) instead of once?
STEP_UPDATES = {
    "a": "w.assign_sub(lr * g)                        # plain SGD with the gradient it computed",
    "b": "seen.assign_add(batch_size)                 # examples seen so far",
    "c": "last_step.assign(step)                      # the step number this function trained",
    "d": "best.assign(tf.minimum(best, loss))         # the lowest loss seen",
    "e": "adam.apply_gradients([(g, w)])              # Keras 3 Adam",
    "f": "losses.scatter_nd_update([[step]], [loss])  # this step's loss in a per-step log",
}


def _run_update(letter: str, times: int) -> list[np.ndarray]:
    """Apply update ``letter`` of ``STEP_UPDATES`` ``times`` times to fresh state; return every
    variable it touches (for ``e`` also Adam's own: iterations and moments)."""
    import keras
    import tensorflow as tf

    g, loss, step = tf.constant([0.5, -1.0]), tf.constant(0.7), 3
    state = {"w": tf.Variable([1.0, 2.0]), "seen": tf.Variable(0, dtype=tf.int64),
             "last_step": tf.Variable(-1), "best": tf.Variable(float("inf")),
             "losses": tf.Variable(tf.zeros(6))}
    adam = keras.optimizers.Adam(0.1)
    updates = {
        "a": lambda: state["w"].assign_sub(0.1 * g),
        "b": lambda: state["seen"].assign_add(32),
        "c": lambda: state["last_step"].assign(step),
        "d": lambda: state["best"].assign(tf.minimum(state["best"], loss)),
        "e": lambda: adam.apply_gradients([(g, state["w"])]),
        "f": lambda: state["losses"].scatter_nd_update([[step]], [loss]),
    }
    for _ in range(times):
        updates[letter]()
    extra = [v.numpy() for v in adam.variables] if letter == "e" else []
    return [v.numpy() for v in state.values()] + extra


def not_idempotent() -> set[str]:
    """The letters of ``STEP_UPDATES`` whose state after two runs differs from after one run,
    found by running each (``_run_update``), not from a table."""
    out = set()
    for letter in STEP_UPDATES:
        once, twice = _run_update(letter, 1), _run_update(letter, 2)
        if len(once) != len(twice) or any(not np.array_equal(a, b)
                                          for a, b in zip(once, twice, strict=True)):
            out.add(letter)
    return out


def check_idempotent(answer) -> str:
    """Exercise 1: ``answer`` names the updates of ``STEP_UPDATES`` that a retried function
    would leave wrong (a string of letters such as ``"xy"`` or a set of letters)."""
    if answer is None or answer is ...:
        return "exercise 1: not answered yet"
    letters = {str(a).strip().lower() for a in answer if str(a).strip()}
    unknown = sorted(letters - set(STEP_UPDATES))
    if unknown:
        raise ValueError(f"answer names {unknown}: the updates are {sorted(STEP_UPDATES)}")
    right = not_idempotent()
    if letters == right:
        return ("exercise 1: correct: run twice, those updates move the state twice; the others "
                "write a value that depends only on the step's own inputs")
    missing, extra = sorted(right - letters), sorted(letters - right)
    return (f"exercise 1: not quite ({len(missing)} left out, {len(extra)} wrongly in): run "
            "each update once and twice on fresh variables and compare")


def link_bytes(scheme: str, workers: int, nbytes: float, servers: int = 1
               ) -> dict[str, dict[str, float]]:
    """Bytes each machine's link sends and receives in one synchronous step, counted message by
    message. ``scheme="ps"``: ``servers`` parameter servers on their own machines, the variables
    split evenly over them; every worker pushes each server its share of the ``nbytes`` of
    gradients and pulls back that share of the new weights. ``scheme="ring"``: a ring
    all-reduce of ``nbytes`` over ``workers`` (a reduce-scatter, then an all-gather, each
    ``workers - 1`` steps in which every worker sends one ``nbytes / workers`` chunk to the
    next). Returns ``{"worker:i" / "ps:j": {"sent": bytes, "received": bytes}}``."""
    if scheme not in ("ps", "ring"):
        raise ValueError(f"scheme must be 'ps' or 'ring', not {scheme!r}")
    for name, value in (("workers", workers), ("servers", servers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, not {value!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative number, not {nbytes!r}")
    if scheme == "ring" and servers != 1:
        raise ValueError("a ring all-reduce has no servers: leave servers=1")
    nodes = [f"worker:{w}" for w in range(workers)]
    if scheme == "ps":
        nodes += [f"ps:{s}" for s in range(servers)]
    count = {n: {"sent": 0.0, "received": 0.0} for n in nodes}

    def send(src: str, dst: str, size: float) -> None:
        count[src]["sent"] += size
        count[dst]["received"] += size

    if scheme == "ps":
        for w in range(workers):
            for s in range(servers):
                send(f"worker:{w}", f"ps:{s}", nbytes / servers)  # push the gradient shard
                send(f"ps:{s}", f"worker:{w}", nbytes / servers)  # pull the new weights
    else:
        for _ in range(2 * (workers - 1)):  # reduce-scatter steps, then all-gather steps
            for w in range(workers):
                send(f"worker:{w}", f"worker:{(w + 1) % workers}", nbytes / workers)
    return count


# Exercise 2: 16 workers, a model of 10^9 parameters with float32 gradients
BANDWIDTH_WORKERS, BANDWIDTH_BYTES = 16, 4e9


def _bandwidth_answer() -> tuple[float, float, int]:
    w, m = BANDWIDTH_WORKERS, BANDWIDTH_BYTES
    ps_in = link_bytes("ps", w, m)["ps:0"]["received"]
    ring_out = link_bytes("ring", w, m)["worker:0"]["sent"]
    servers = 1
    while max(v["received"] for k, v in link_bytes("ps", w, m, servers).items()
              if k.startswith("ps:")) > ring_out:
        servers += 1
    return ps_in, ring_out, servers


def check_bandwidth(answer) -> str:
    """Exercise 2: ``(bytes one ps receives per step, bytes each worker sends per step in a ring
    all-reduce, the fewest ps tasks that keep every ps link at or below a ring worker's)`` for
    ``BANDWIDTH_WORKERS`` workers and ``BANDWIDTH_BYTES`` of gradients."""
    if answer is None or answer is ... or None in answer or ... in answer:
        return "exercise 2: not answered yet"
    if len(answer) != 3:
        raise ValueError(f"answer must be (ps bytes, ring bytes, servers), not {answer!r}")
    right = _bandwidth_answer()
    wrong = [name for name, a, r in zip(("ps bytes", "ring bytes", "servers"), answer, right,
                                        strict=True)
             if not np.isclose(float(a), r, rtol=1e-6, atol=0)]
    if not wrong:
        return ("exercise 2: correct: one ps receives N times the model, a ring worker sends "
                "under twice the model whatever N is; sharding brings the ps links down only "
                "with about half as many ps machines as workers")
    return f"exercise 2: not quite: check {', '.join(wrong)} with clusters.link_bytes"
