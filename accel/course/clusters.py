"""Chapter 12's set-up, benchmark and exercises: one small regression problem shared by every
replicated run; ``python -m accel bench cluster`` (start-up of 1 ps + 2 workers, then examples
per second of the four replication combinations against one process running the same graph);
the checks of exercise 1 (which step updates a retried function leaves wrong, under
at-least-once with reordering: each update simulated exactly once and with one step retried
after later ones), exercise 2 (bytes per link per synchronous step, dedicated and colocated
parameter servers against a ring all-reduce, counted message by message by ``link_bytes``) and
exercise 3 (Young's checkpoint interval for a failure rate)."""

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
           "check_bandwidth", "FAILURES", "SAVE_SECONDS", "check_checkpoint"]


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


# Exercise 3: Llama 3 405B's pre-training, 419 unexpected interruptions in 54 days on up to 16K
# GPUs (Dubey et al. 2024, section 3.3.4); an assumed save that stalls training for 60 s
FAILURES = {"unexpected interruptions": 419, "days": 54}
SAVE_SECONDS = 60.0


def _young(save: float, mtbf: float) -> float:
    return math.sqrt(2.0 * save * mtbf)


def _checkpoint_answer() -> tuple[float, float, float]:
    mtbf = FAILURES["days"] * 86400.0 / FAILURES["unexpected interruptions"]
    now, larger = _young(SAVE_SECONDS, mtbf), _young(SAVE_SECONDS, mtbf / 4)
    lost = SAVE_SECONDS / larger + larger / (2 * mtbf / 4)
    return now / 60.0, larger / 60.0, lost


def check_checkpoint(answer) -> str:
    """Exercise 3: ``(Young's interval in minutes for the job's failure rate, the interval in
    minutes for a job four times larger with the same failure rate per GPU, the fraction of
    time the larger job loses to saves and recomputation at its interval)``."""
    if answer is None or answer is ... or None in answer or ... in answer:
        return "exercise 3: not answered yet"
    if len(answer) != 3:
        raise ValueError(f"answer must be (minutes, minutes, fraction), not {answer!r}")
    right = _checkpoint_answer()
    names = ("interval now", "interval at 4x", "time lost at 4x")
    wrong = [n for n, a, r in zip(names, answer, right, strict=True)
             if not np.isclose(float(a), r, rtol=0.02, atol=0)]
    if not wrong:
        return ("exercise 3: correct: four times the GPUs, a quarter of the MTBF: the interval "
                "halves and the time lost doubles; only a cheaper save (or restart) brings it "
                "back down")
    return f"exercise 3: not quite: check {', '.join(wrong)} (within 2%)"
