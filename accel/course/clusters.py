"""Chapter 12's set-up, benchmark and exercises: one small regression problem shared by every
replicated run; ``python -m accel bench cluster`` (start-up of 1 ps + 2 workers, then examples
per second of the four replication combinations against one process running the same graph);
the checks of exercise 1 (which step updates a retried function leaves wrong, under
at-least-once with reordering: each update simulated exactly once and with one step retried
after later ones), exercise 2 (bytes per link per synchronous step, dedicated and colocated
parameter servers against a ring all-reduce, counted message by message by ``link_bytes``) and
exercise 3 (backup workers against stragglers: the expected time of a synchronous step)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from accel import datasets, models, timing
from accel.distributed import replication as rep
from accel.distributed.cluster import LocalCluster

__all__ = ["problem", "bench", "STEP_UPDATES", "RETRY_ORDER", "not_idempotent",
           "check_idempotent", "link_bytes", "BANDWIDTH_WORKERS", "BANDWIDTH_BYTES",
           "check_bandwidth", "STRAGGLERS", "sync_step_time", "check_backup"]


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
    steps only, cluster and client set-up excluded; the first step of each client or thread
    also records what it sent between tasks) as ratios to one process, and how the wall time
    splits into start-up and training. ``device_names`` is unused: the cluster's tasks are
    processes. ``quick``: a few steps of in-graph sync and between-graph async only.

    Rates are per example, not per update: an asynchronous run makes two updates per global
    batch, each on half of it. On one machine every combination is slower than one process:
    each step pays for RPCs between processes that share its cores (the chapter counts the
    tensors each step sends), and with a small model little else is measured, so the order
    between the four combinations is not stable from run to run; the printed ceiling (2-thread
    vs 1-thread matmul) says how busy the machine was. A real network is the chapter's cost
    model, not this."""
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
    print(timing.ceiling_line())
    return {"startup_s": startup, "ratios": ratios, "baseline_examples_per_s": base_rate,
            "training_share": trained / total}


# Exercise 1: a step function reads the weights, computes its gradient ``g`` and ``loss`` on
# batch ``step``, and makes these updates on the ps. Under at-least-once with reordering (a
# function cut off after its updates reached the ps runs again later, after other steps), which
# leave a state different from every step running exactly once?
STEP_UPDATES = {
    "a": "w.assign_sub(lr * g)                         # plain SGD",
    "b": "seen.assign_add(batch_size)                  # examples seen so far",
    "c": "last_step.assign(step)                       # the step this function trained",
    "d": "done.assign(tf.maximum(done, step))          # the highest step trained",
    "e": "adam.apply_gradients([(g, w)])               # Keras 3 Adam instead of (a)",
    "f": "trained.scatter_nd_update([[step]], [True])  # a flag per step: batch trained",
    "g": "losses.scatter_nd_update([[step]], [loss])   # this step's loss in a per-step log",
}
EXACTLY_ONCE = (0, 1, 2, 3)
RETRY_ORDER = (0, 1, 2, 3, 1)  # step 1's function ran, its worker died, it ran again after 3


def _simulate(order: tuple[int, ...], optimizer: str) -> dict[str, list[np.ndarray]]:
    """Run the step functions in ``order`` on fresh state (a linear model ``w`` trained with
    plain SGD, or with Keras 3 Adam for ``e``), each making every update of ``STEP_UPDATES``;
    return each letter's state."""
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 8, 2)).astype(np.float32)
    ys = (xs @ np.array([1.5, -2.0], np.float32) + 0.3).astype(np.float32)
    w = tf.Variable([0.0, 0.0])
    seen, last_step = tf.Variable(0, dtype=tf.int64), tf.Variable(-1)
    done, trained = tf.Variable(-1), tf.Variable(tf.zeros(4, tf.bool))
    losses, adam = tf.Variable(tf.zeros(4)), keras.optimizers.Adam(0.1)
    for step in order:
        with tf.GradientTape() as tape:  # at the weights as they are now
            loss = tf.reduce_mean(tf.square(tf.linalg.matvec(xs[step], w) - ys[step]))
        g = tape.gradient(loss, w)
        if optimizer == "sgd":
            w.assign_sub(0.1 * g)
        else:
            adam.apply_gradients([(g, w)])
        seen.assign_add(8)
        last_step.assign(step)
        done.assign(tf.maximum(done, step))
        trained.scatter_nd_update([[step]], [True])
        losses.scatter_nd_update([[step]], [loss])
    out = {"b": [seen], "c": [last_step], "d": [done], "f": [trained], "g": [losses]}
    out["a" if optimizer == "sgd" else "e"] = [w, *adam.variables]
    return {k: [v.numpy() for v in vs] for k, vs in out.items()}


def not_idempotent() -> set[str]:
    """The letters of ``STEP_UPDATES`` whose state after ``RETRY_ORDER`` differs from after
    ``EXACTLY_ONCE``, found by running both (``_simulate``), not from a table."""
    out = set()
    for optimizer in ("sgd", "adam"):
        once, retried = _simulate(EXACTLY_ONCE, optimizer), _simulate(RETRY_ORDER, optimizer)
        for letter in once:
            if optimizer == "adam" and letter != "e":
                continue  # the others were judged with plain SGD
            if any(not np.array_equal(a, b)
                   for a, b in zip(once[letter], retried[letter], strict=True)):
                out.add(letter)
    return out


def check_idempotent(answer) -> str:
    """Exercise 1: ``answer`` names the updates of ``STEP_UPDATES`` that a retry leaves wrong
    under at-least-once with reordering (a string of letters such as ``"xy"`` or a set)."""
    if answer is None or answer is ...:
        return "exercise 1: not answered yet"
    letters = {str(a).strip().lower() for a in answer if str(a).strip()}
    unknown = sorted(letters - set(STEP_UPDATES))
    if unknown:
        raise ValueError(f"answer names {unknown}: the updates are {sorted(STEP_UPDATES)}")
    right = not_idempotent()
    if letters == right:
        return ("exercise 1: correct: the retry runs later, at weights that have moved: a and e "
                "apply one more update, b counts a batch twice, c goes back to step 1, g "
                "overwrites step 1's loss with a loss at later weights; a maximum (d) and a "
                "flag per step (f) end the same in any order, however often a step runs")
    missing, extra = sorted(right - letters), sorted(letters - right)
    return (f"exercise 1: not quite ({len(missing)} left out, {len(extra)} wrongly in): run "
            f"the steps in the order {RETRY_ORDER} and in {EXACTLY_ONCE}, each reading the "
            "weights as they are when it runs, and compare")


def link_bytes(scheme: str, workers: int, nbytes: float, servers: int = 1,
               colocated: bool = False) -> dict[str, dict[str, float]]:
    """Bytes each machine's link sends and receives in one synchronous step, counted message by
    message. ``scheme="ps"``: ``servers`` parameter servers, the variables split evenly over
    them; every worker pushes each server its share of the ``nbytes`` of gradients and pulls
    back that share of the new weights. The servers run on machines of their own
    (``"ps:j"``), or with ``colocated=True`` one on each worker's machine (``servers`` must
    equal ``workers``; a machine's messages to itself do not cross its link). ``scheme="ring"``:
    a ring all-reduce of ``nbytes`` over ``workers`` (a reduce-scatter, then an all-gather, each
    ``workers - 1`` steps in which every worker sends one ``nbytes / workers`` chunk to the
    next). Returns ``{"worker:i" / "ps:j": {"sent": bytes, "received": bytes}}`` (colocated:
    ``{"machine:i": ...}``)."""
    if scheme not in ("ps", "ring"):
        raise ValueError(f"scheme must be 'ps' or 'ring', not {scheme!r}")
    for name, value in (("workers", workers), ("servers", servers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, not {value!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative number, not {nbytes!r}")
    if scheme == "ring" and (servers != 1 or colocated):
        raise ValueError("a ring all-reduce has no servers: leave servers=1, colocated=False")
    if colocated and servers != workers:
        raise ValueError(f"colocated=True puts one ps on each worker's machine: servers must be "
                         f"{workers}, not {servers}")
    worker = [f"machine:{w}" if colocated else f"worker:{w}" for w in range(workers)]
    server = [f"machine:{s}" if colocated else f"ps:{s}" for s in range(servers)]
    count = {n: {"sent": 0.0, "received": 0.0} for n in dict.fromkeys(
        worker + (server if scheme == "ps" else []))}

    def send(src: str, dst: str, size: float) -> None:
        if src != dst:  # a message to the same machine does not cross its link
            count[src]["sent"] += size
            count[dst]["received"] += size

    if scheme == "ps":
        for w in range(workers):
            for s in range(servers):
                send(worker[w], server[s], nbytes / servers)  # push the gradient shard
                send(server[s], worker[w], nbytes / servers)  # pull the new weights
    else:
        for _ in range(2 * (workers - 1)):  # reduce-scatter steps, then all-gather steps
            for w in range(workers):
                send(worker[w], worker[(w + 1) % workers], nbytes / workers)
    return count


# Exercise 2: 16 workers, a model of 10^9 parameters with float32 gradients
BANDWIDTH_WORKERS, BANDWIDTH_BYTES = 16, 4e9


def _bandwidth_answer() -> tuple[int, float]:
    w, m = BANDWIDTH_WORKERS, BANDWIDTH_BYTES
    ring_out = link_bytes("ring", w, m)["worker:0"]["sent"]
    servers = 1
    while max(v["received"] for k, v in link_bytes("ps", w, m, servers).items()
              if k.startswith("ps:")) > ring_out:
        servers += 1
    colocated = link_bytes("ps", w, m, w, colocated=True)["machine:0"]["sent"]
    return servers, colocated


def check_bandwidth(answer) -> str:
    """Exercise 2: ``(the fewest dedicated ps machines that keep every ps link at or below what
    a ring worker sends, the bytes each machine sends per step with one ps on every worker's
    machine)`` for ``BANDWIDTH_WORKERS`` workers and ``BANDWIDTH_BYTES`` of gradients."""
    if answer is None or answer is ... or None in answer or ... in answer:
        return "exercise 2: not answered yet"
    if len(answer) != 2:
        raise ValueError(f"answer must be (ps machines, bytes per machine), not {answer!r}")
    right = _bandwidth_answer()
    wrong = [name for name, a, r in zip(("ps machines", "colocated bytes"), answer, right,
                                        strict=True)
             if not np.isclose(float(a), r, rtol=1e-6, atol=0)]
    if not wrong:
        return ("exercise 2: correct: dedicated servers match a ring only with about half as "
                "many ps machines as workers; one ps shard on every worker's machine sends "
                "exactly what a ring worker sends: a reduce-scatter and an all-gather")
    return f"exercise 2: not quite: check {', '.join(wrong)} with clusters.link_bytes"


# Exercise 3: backup workers (Chen et al. 2016, "Revisiting Distributed Synchronous SGD",
# arXiv:1604.00981): 16 workers, each step takes 1 s, but each worker independently straggles
# (3 s) in 1% of its steps; a step ends when ``aggregate`` gradients are in
STRAGGLERS = {"workers": 16, "step_s": 1.0, "slow_s": 3.0, "p_slow": 0.01}


def sync_step_time(workers: int, aggregate: int, step_s: float, slow_s: float,
                   p_slow: float) -> float:
    """Expected seconds of one synchronous step that ends when the first ``aggregate`` of
    ``workers`` gradients are in (``SyncReplicasOptimizer(replicas_to_aggregate=aggregate,
    total_num_replicas=workers)``; ``aggregate == workers``: no backup), when each worker takes
    ``step_s`` seconds, or independently with probability ``p_slow`` ``slow_s`` seconds. The step
    is slow when more than ``workers - aggregate`` workers are: a binomial tail."""
    if not 1 <= aggregate <= workers:
        raise ValueError(f"need 1 <= aggregate <= workers, not {aggregate} of {workers}")
    if not 0.0 <= p_slow <= 1.0:
        raise ValueError(f"p_slow must be a probability, not {p_slow}")
    if not 0.0 < step_s <= slow_s:
        raise ValueError(f"need 0 < step_s <= slow_s, not {step_s} and {slow_s}")
    spare = workers - aggregate
    fast_enough = sum(math.comb(workers, k) * p_slow ** k * (1.0 - p_slow) ** (workers - k)
                      for k in range(spare + 1))
    return step_s + (slow_s - step_s) * (1.0 - fast_enough)


def _backup_answer() -> tuple[float, float, float]:
    s = STRAGGLERS
    w = s["workers"]
    every = sync_step_time(w, w, s["step_s"], s["slow_s"], s["p_slow"])
    backup = sync_step_time(w, w - 1, s["step_s"], s["slow_s"], s["p_slow"])
    return every, backup, ((w - 1) / backup) / (w / every)


def check_backup(answer) -> str:
    """Exercise 3: ``(the expected step time waiting for all 16 gradients, the expected step time
    averaging the first 15 (one backup worker), the gradients applied per second with the backup
    as a multiple of those without)`` for ``STRAGGLERS``."""
    if answer is None or answer is ... or None in answer or ... in answer:
        return "exercise 3: not answered yet"
    if len(answer) != 3:
        raise ValueError(f"answer must be (seconds, seconds, ratio), not {answer!r}")
    right = _backup_answer()
    names = ("step time, all 16", "step time, first 15", "gradients per second ratio")
    wrong = [n for n, a, r in zip(names, answer, right, strict=True)
             if not np.isclose(float(a), r, rtol=0.01, atol=0)]
    if not wrong:
        return ("exercise 3: correct: with 16 workers one straggler in 100 steps per worker "
                "slows about one step in seven; a backup worker makes that about one in a "
                "hundred, at the price of one gradient in 16 dropped every step")
    return f"exercise 3: not quite: check {', '.join(wrong)} (within 1%)"
