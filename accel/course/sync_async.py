"""Chapter 06's experiments: a toy problem for the parameter server, the sync-async benchmark,
the fair race (sync with a scaled learning rate against async, locked and lock-free), why measured
throughput ratios beat the ideal ones, the measured figures and the exercise checks."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

from accel import checks, datasets, devices, models, viz
from accel.parallel import parameter_server as ps
from accel.parallel.staleness import TrainResult, staleness_histogram
from accel.training import squared_error

__all__ = ["toy_problem", "bench_sync_async", "cycle_times", "explain_ratios", "figure_race",
           "figure_staleness", "check_exercise", "RACE_METHODS", "race_increments"]


def toy_problem(n: int = 768, features: int = 8, hidden: int = 16, seed: int = 0) -> dict:
    """A small learnable regression task and MLP, as keyword arguments for ``train``:
    ``model_fn``, ``loss_fn``, ``params`` (NumPy), ``x``, ``y``."""
    x, y, _ = datasets.regression(n=n, features=features, seed=seed)
    return {"model_fn": models.mlp_apply, "loss_fn": squared_error,
            "params": models.mlp_init([features, hidden, 1], seed=seed), "x": x, "y": y}


def bench_sync_async(device_names: Sequence[str], quick: bool = False, rounds: int = 15,
                     step_time: float = 0.02, factor: float = 4.0) -> dict:
    """``python -m accel bench sync-async``: examples/s of sync, async (with the server's lock
    and lock-free) and K-of-N (K = N - 1) with one worker ``factor`` times slower, as ratios to
    sync without a straggler.

    ps on the first device, workers on the others; every step is padded to ``step_time``
    seconds, so the ratios show scheduling, not the shared CPU cores. Throughput counts the
    examples of applied updates up to the last applied update (``TrainResult.wall_time``).
    Returns the ``ratios``, the ``examples_per_s`` and the ``runs`` themselves.
    """
    names = list(device_names)
    rounds = 2 if quick else rounds
    workers, n = names[1:], len(names) - 1
    common = dict(toy_problem(), workers=workers, ps_device=names[0], step_time=step_time,
                  optimizer=0.05)
    slow = {n - 1: factor}
    ps.train_sync(**common, steps=1)  # trace every worker's step once, outside the timings
    runs = {"sync": ps.train_sync(**common, steps=rounds),
            "sync, straggler": ps.train_sync(**common, steps=rounds, slowdown=slow),
            "async, straggler": ps.train_async(**common, steps=rounds * n, slowdown=slow),
            "lock-free, straggler": ps.train_hogwild(**common, steps=rounds * n, slowdown=slow),
            f"{n - 1}-of-{n}, straggler": ps.train_k_of_n(**common, k=n - 1, slowdown=slow,
                                                          steps=rounds * n // (n - 1))}
    base = runs["sync"].examples_per_s
    print(f"throughput relative to sync without a straggler ({n} workers, one {factor:g}x slower)")
    out = {}
    for name, result in runs.items():
        out[name] = result.examples_per_s / base
        print(f"  {name:20s} {result.examples_per_s:9.0f} examples/s  {out[name]:5.2f}x")
    return {"ratios": out, "examples_per_s": {k: r.examples_per_s for k, r in runs.items()},
            "runs": runs}


def cycle_times(result: TrainResult, num_workers: int) -> list[float]:
    """Mean seconds between two gradients of the same worker reaching the server, per worker
    (NaN for a worker with fewer than two): its whole cycle, not just its compute."""
    out = []
    for w in range(num_workers):
        times = sorted(r.time for r in result.records if r.worker == w)
        out.append(float(np.mean(np.diff(times))) if len(times) > 1 else float("nan"))
    return out


def explain_ratios(runs: Mapping[str, TrainResult], n: int, factor: float,
                   step_time: float) -> dict[str, float]:
    """Why ``bench_sync_async``'s measured ratios beat the ideal ones: print the ideal ratios
    (all time in the padded compute) next to the cycle and round times the runs measured, and
    the ratios those times predict. Returns the measured times and predictions."""
    sync_round = runs["sync"].wall_time / len(runs["sync"].applied) * n
    cycles = cycle_times(runs["async, straggler"], n)
    fast, slow = float(np.mean(cycles[:-1])), cycles[-1]
    kofn = runs[f"{n - 1}-of-{n}, straggler"]
    kofn_round = kofn.wall_time / (len(kofn.applied) / (n - 1))
    facts = {"step_time": step_time, "sync_round": sync_round, "fast_cycle": fast,
             "straggler_cycle": slow, "effective_slowdown": slow / fast,
             "kofn_round": kofn_round,
             "async_ideal": (n - 1 + 1 / factor) / n,
             "async_from_times": sync_round / n * ((n - 1) / fast + 1 / slow),
             "kofn_ideal": (n - 1) / n, "kofn_from_times": (n - 1) / n * sync_round / kofn_round}
    print(f"padded compute per step {step_time * 1e3:6.1f} ms; sync round (no straggler) "
          f"{sync_round * 1e3:6.1f} ms")
    print(f"async cycle: fast workers {fast * 1e3:6.1f} ms, straggler {slow * 1e3:6.1f} ms "
          f"-> effective slowdown {slow / fast:4.2f} (padded: {factor:g})")
    print(f"{n - 1}-of-{n} round {kofn_round * 1e3:6.1f} ms")
    for name, key in (("async", "async"), (f"{n - 1}-of-{n}", "kofn")):
        print(f"{name:7s} ideal {facts[key + '_ideal']:4.2f}   from measured times "
              f"{facts[key + '_from_times']:4.2f}")
    return facts


def figure_race(results: Mapping[str, TrainResult]):
    """Full-data loss against examples (left) and against wall-clock seconds (right) for each
    run of ``results`` (runs made with ``eval_every``)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, r in results.items():
        losses = [loss for _, loss in r.curve]
        left.plot([ex for ex, _ in r.curve], losses, label=name)
        right.plot(r.curve_time, losses, label=name)
    left.set(xlabel="examples applied", ylabel="full-data loss (MSE)", yscale="log",
             title="per example")
    right.set(xlabel="seconds since the start", yscale="log", title="per second of wall time")
    left.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figure_staleness(async_result: TrainResult | None = None,
                     delayed: dict[int, TrainResult] | None = None):
    """Left: staleness histogram of an asynchronous run. Right: full-data loss against examples
    for controlled delays ``k`` (``{k: result of train_delayed(..., eval_every=...)}``).
    Missing inputs are computed on ``toy_problem()``. The left panel is a measurement: the
    chapter saves it with ``registry.save_measured_figure``."""
    import matplotlib.pyplot as plt

    if async_result is None or delayed is None:
        names = devices.setup(4)
        common = dict(toy_problem(), workers=names[1:], ps_device=names[0], optimizer=0.02)
    if async_result is None:
        async_result = ps.train_async(**common, steps=300, step_time=0.001)
    if delayed is None:
        delayed = {k: ps.train_delayed(**common, delay=k, steps=300, eval_every=10)
                   for k in (0, 1, 4, 16)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    hist = staleness_histogram(async_result.records)
    left.bar(range(len(hist)), hist, color="#4C72B0")
    left.xaxis.get_major_locator().set_params(integer=True)
    workers = len({r.worker for r in async_result.records})
    left.set(xlabel="staleness (updates between read and apply)", ylabel="gradients",
             title=f"async, {workers} workers: measured staleness")
    series = {f"delay k={k}": [loss for _, loss in r.curve] for k, r in delayed.items()}
    xs = [ex for ex, _ in next(iter(delayed.values())).curve]
    viz.curves(series, "examples applied", "full-data loss (MSE)", ax=right, x=xs, logy=True,
               title="controlled staleness: harm grows with k")
    fig.tight_layout()
    return fig


def check_exercise(number: int, answer, device_names: Sequence[str] | None = None) -> str:
    """The chapter's exercise checks: ``"not answered yet"`` for ``None``, else whether
    ``answer`` is right. 1: a learning rate at which delay 16 ends below loss 0.5 in 300
    updates on ``toy_problem()`` (runs it on ``device_names``); 2: the largest staleness an
    applied gradient can have in K-of-N with ``k=1``; 3: the ideal throughput of sync training
    with one of 3 workers 8 times slower, as a fraction of sync without it."""
    checks.one_of("number", number, (1, 2, 3))
    if answer is None:
        return f"exercise {number}: not answered yet"
    if number == 1:
        if isinstance(answer, bool) or not isinstance(answer, int | float) or not answer > 0:
            return "exercise 1: a learning rate is a number > 0"
        names = list(device_names or devices.setup(4))
        run = ps.train_delayed(**toy_problem(), workers=names[1:], ps_device=names[0],
                               delay=16, steps=300, optimizer=float(answer))
        ok = bool(run.final_loss < 0.5)
    elif number == 2:
        ok = answer == 0 and not isinstance(answer, bool)
    else:
        ok = isinstance(answer, int | float) and abs(answer - 1 / 8) < 0.01
    return f"exercise {number}: " + ("correct" if ok else "not quite, try again")


RACE_METHODS = ("read_then_assign", "apply", "apply_locked")


def race_increments(device: str, method: str = "apply", threads: int = 3, repeats: int = 100,
                    size: int = 1 << 16) -> dict[str, float]:
    """``threads`` threads each add 1 to every element of one shared float32 vector of ``size``
    elements on ``device``, ``repeats`` times, without any Python lock. ``method``:
    ``read_then_assign`` reads the vector, adds 1 and assigns the result (two ops: another
    thread's addition between them is overwritten); ``apply`` uses one
    ``ResourceApplyGradientDescent`` with ``use_locking=False`` (TensorFlow's default: the
    variable's lock is shared, concurrent updates may interleave; TensorFlow calls the result
    undefined); ``apply_locked`` the same op with ``use_locking=True`` (exclusive lock). Returns
    ``expected`` (each element's value if no addition was lost), ``lowest`` (the smallest
    element) and ``lost`` (missing additions, averaged over the elements)."""
    checks.one_of("method", method, RACE_METHODS)
    checks.positive_int("threads", threads)
    checks.positive_int("repeats", repeats)
    checks.positive_int("size", size)
    with tf.device(device):
        var = tf.Variable(tf.zeros(size))
        minus_one, one = tf.fill([size], -1.0), tf.constant(1.0)

    def work():
        for _ in range(repeats):
            if method == "read_then_assign":
                var.assign(var.read_value() + one)
            else:
                tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=one,
                                                        delta=minus_one,
                                                        use_locking=method == "apply_locked")

    pool = [threading.Thread(target=work, name=f"race-{j}", daemon=True) for j in range(threads)]
    try:
        for t in pool:
            t.start()
    finally:
        for t in pool:
            t.join()
    values = var.numpy().astype(np.float64)
    expected = threads * repeats
    return {"expected": expected, "lowest": float(values.min()),
            "lost": float(expected - values.mean())}
