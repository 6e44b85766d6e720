"""Chapter 06's experiments: a toy problem for the parameter server, the sync-async benchmark
(time to a target loss of sync, async and K of N, with and without a straggler), the fair race
(sync with a scaled learning rate against async, locked and lock-free), the harness's own time
next to the measured and ideal throughput ratios, the measured figures and the exercise checks."""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

from accel import checks, datasets, devices, models, timing, viz
from accel.parallel import parameter_server as ps
from accel.parallel.staleness import TrainResult, staleness_histogram
from accel.training import squared_error

__all__ = ["toy_problem", "bench_sync_async", "cycle_times", "explain_ratios", "figure_race",
           "figure_time_to_target", "figure_staleness", "STRAGGLER_STALENESS", "MOMENTUM_DELAYS",
           "MOMENTUM_LARGEST_DELAY", "check_exercise", "RACE_METHODS",
           "ROW", "race_increments"]


def toy_problem(n: int = 768, features: int = 8, hidden: int = 16, seed: int = 0) -> dict:
    """A small learnable regression task and MLP, as keyword arguments for ``train``:
    ``model_fn``, ``loss_fn``, ``params`` (NumPy), ``x``, ``y``."""
    x, y, _ = datasets.regression(n=n, features=features, seed=seed)
    return {"model_fn": models.mlp_apply, "loss_fn": squared_error,
            "params": models.mlp_init([features, hidden, 1], seed=seed), "x": x, "y": y}


def bench_sync_async(device_names: Sequence[str], quick: bool = False, repeats: int = 5,
                     step_time: float = 0.1, factor: float = 4.0, target_loss: float = 0.5,
                     learning_rate: float = 0.03, explain: bool = True) -> dict:
    """``python -m accel bench sync-async``: time to a target loss of sync, async (with the
    server's lock) and K of N (K = N - 1), with equal workers and with one worker ``factor``
    times slower, as medians of ``repeats`` interleaved repetitions with their min-max spread
    and ratios to sync taken within each repetition (``parameter_server.race_to_target``: the
    same warm-up and clock for every variant). Then, with ``explain`` (the default, as
    ``python -m accel bench sync-async`` runs it), the harness's own time per round and the
    throughput ratios it explains (``explain_ratios``, on the last repetition's runs); always
    this machine's ceiling. Chapter 06 passes ``explain=False``: ``times`` is still returned.

    How to read the seconds: the compute is a sleep, so a round of sync costs the padded step
    plus the harness's own time (barrier, averaging, the update, thread wake-ups, and the
    full-data loss that ``target_loss`` evaluates under the server's lock after every update:
    async pays that evaluation once per gradient, sync once per N gradients). That fixed
    per-update cost moves the measured ratios away from the ideal ones (async 1, a straggler
    ``factor`` times slower: sync ``factor``, async ``N / (N - 1 + 1 / factor)``, K of N
    ``N / K``) and dilutes the straggler's slowdown in sync's rounds.

    ps on the first device, workers on the others, ``toy_problem()``; the full-data loss is
    evaluated after every update, and a run stops at the first one at or below
    ``target_loss`` (400 updates at most). ``learning_rate`` is async's, for 32 examples; sync
    and K of N scale it with their batch (linear scaling, as chapter 06's fair race). Every
    step is padded to ``step_time`` seconds (100 ms: the harness's own time per round, a few
    ms on two shared cores, stays a small share; chapter 06 uses 30 ms to fit its time, where
    the share is larger). ``quick``: one repetition of 10 ms steps, only to check
    that it works. Returns ``summary`` (per variant: ``median``, ``min``, ``max`` seconds,
    ``ratio`` to sync, median ``updates``, ``examples``, ``gradients``, ``dropped``,
    ``reached``), ``hits`` (every repetition's ``TargetHit``), ``runs`` (the last
    repetition's ``TrainResult`` per variant), ``times`` (``explain_ratios``), ``step_time``,
    ``factor``, ``target_loss``, ``repeats`` and the ``ceiling``.
    """
    names = list(device_names)
    if len(names) < 3:
        raise ValueError(f"need a ps device and at least 2 workers, got {names}")
    checks.positive_number("learning_rate", learning_rate)
    repeats, step_time = (1, min(step_time, 0.01)) if quick else (repeats, step_time)
    workers, n = names[1:], len(names) - 1
    common = dict(toy_problem(), workers=workers, ps_device=names[0], step_time=step_time,
                  steps=400)
    slow, kofn = {n - 1: factor}, f"{n - 1}-of-{n}"
    modes = {"sync": dict(mode="sync", optimizer=n * learning_rate),
             "async": dict(mode="async", optimizer=learning_rate),
             kofn: dict(mode="k_of_n", k=n - 1, optimizer=(n - 1) * learning_rate)}
    variants = {**{name: {**common, **kw} for name, kw in modes.items()},
                **{f"{name}, straggler": {**common, **kw, "slowdown": slow}
                   for name, kw in modes.items()}}
    race = ps.race_to_target(variants, target_loss=target_loss, repeats=repeats,
                             baseline="sync")
    print(f"time to full-data loss <= {target_loss:g} ({n} workers, steps padded to "
          f"{step_time * 1e3:g} ms, straggler: one worker {factor:g}x slower; learning rate "
          f"{learning_rate:g} per 32 examples, scaled with the batch; {repeats} "
          f"repetition{'s' if repeats > 1 else ''})")
    print("                       seconds: median (min-max)  / sync   updates  examples"
          "  gradients (dropped)")
    for name, row in race["summary"].items():
        print(f"  {name:20s} {row['median']:9.3f} ({row['min']:.3f}-{row['max']:.3f})"
              f"  {row['ratio']:6.2f}  {row['updates']:8.0f}  {row['examples']:8.0f}"
              f"  {row['gradients']:6.0f} ({row['dropped']:.0f})"
              + ("" if row["reached"] == repeats else
                 f"   reached in {row['reached']} of {repeats}"))
    runs = {name: results[-1] for name, results in race["runs"].items()}
    if explain:
        print()
        times = explain_ratios(runs, n=n, factor=factor, step_time=step_time)
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            times = explain_ratios(runs, n=n, factor=factor, step_time=step_time)
    measured = timing.measure_ceiling()
    print(timing.ceiling_line(measured))
    return {"summary": race["summary"], "hits": race["hits"], "runs": runs, "times": times,
            "step_time": step_time, "factor": factor, "target_loss": target_loss,
            "repeats": repeats, "ceiling": measured.value}


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
    """What ``bench_sync_async``'s runs spent outside the padded compute, and the ratios that
    explains: print the harness overhead of a sync round (round time minus ``step_time``:
    barrier, averaging, update, thread wake-ups) and of an async cycle, the straggler's
    effective slowdown, and per run the ideal ratio (all time in the padded compute), the ratio
    the measured round and cycle times predict, and the measured one. Returns those numbers."""
    sync_round = runs["sync"].wall_time / len(runs["sync"].applied) * n
    async_cycle = float(np.mean(cycle_times(runs["async"], n)))
    cycles = cycle_times(runs["async, straggler"], n)
    fast, slow = float(np.mean(cycles[:-1])), cycles[-1]
    kofn = runs[f"{n - 1}-of-{n}, straggler"]
    kofn_round = kofn.wall_time / (len(kofn.applied) / (n - 1))
    base = runs["sync"].examples_per_s
    facts = {"step_time": step_time, "sync_round": sync_round,
             "sync_overhead": sync_round - step_time, "async_cycle": async_cycle,
             "async_overhead": async_cycle - step_time, "fast_cycle": fast,
             "straggler_cycle": slow, "effective_slowdown": slow / fast,
             "kofn_round": kofn_round,
             "async_ideal": 1.0, "async_from_times": sync_round / async_cycle,
             "async_measured": runs["async"].examples_per_s / base,
             "async_straggler_ideal": (n - 1 + 1 / factor) / n,
             "async_straggler_from_times": sync_round / n * ((n - 1) / fast + 1 / slow),
             "async_straggler_measured": runs["async, straggler"].examples_per_s / base,
             "kofn_ideal": (n - 1) / n, "kofn_from_times": (n - 1) / n * sync_round / kofn_round,
             "kofn_measured": kofn.examples_per_s / base}
    print(f"padded compute per step {step_time * 1e3:6.1f} ms")
    for name, whole, part in (("sync round ", sync_round, "round"),
                              ("async cycle", async_cycle, "cycle")):
        over = whole - step_time
        print(f"{name} {whole * 1e3:6.1f} ms: harness overhead {over * 1e3:5.1f} ms = "
              f"{over / whole:4.0%} of the {part}")
    print(f"with the straggler: async cycles {fast * 1e3:6.1f} ms (fast), {slow * 1e3:6.1f} ms "
          f"(straggler) -> effective slowdown {slow / fast:4.2f} (padded: {factor:g}); "
          f"{n - 1}-of-{n} round {kofn_round * 1e3:6.1f} ms")
    print("throughput / sync's  ideal   from measured times   measured")
    for name, key in (("async", "async"), ("async, straggler", "async_straggler"),
                      (f"{n - 1}-of-{n}, straggler", "kofn")):
        print(f"  {name:18s} {facts[key + '_ideal']:5.2f}   {facts[key + '_from_times']:11.2f}"
              f"   {facts[key + '_measured']:14.2f}")
    return facts


def figure_race(results: Mapping[str, TrainResult]):
    """Full-data loss against examples applied for each run of ``results`` (runs made with
    ``eval_every``): the per-example race. Per second, with equal workers both modes compute one
    gradient per worker per step; what the barrier adds is ``bench_sync_async``'s to measure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, r in results.items():
        ax.plot([ex for ex, _ in r.curve], [loss for _, loss in r.curve], label=name)
    ax.set(xlabel="examples applied", ylabel="full-data loss (MSE)", yscale="log",
           title="the same examples: sync (two learning rates) vs async")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figure_time_to_target(summary: Mapping[str, Mapping[str, float]], target_loss: float = 0.5):
    """``bench_sync_async``'s ``summary`` drawn: per variant a bar at the median seconds to the
    target with a whisker from the fastest to the slowest repetition; straggler runs hatched."""
    import matplotlib.pyplot as plt

    names = list(summary)
    medians = np.array([summary[k]["median"] for k in names])
    spread = np.array([[summary[k]["median"] - summary[k]["min"],
                        summary[k]["max"] - summary[k]["median"]] for k in names]).T
    fig, ax = plt.subplots(figsize=(6, 3.2))
    colours = {"sync": "#4C72B0", "async": "#DD8452"}
    for i, name in enumerate(names):
        mode = name.split(",")[0]
        ax.barh(i, medians[i], color=colours.get(mode, "#55A868"),
                hatch="//" if "straggler" in name else None, edgecolor="white")
    ax.errorbar(medians, range(len(names)), xerr=spread, fmt="none", ecolor="black",
                capsize=3, lw=1)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set(xlabel=f"seconds to full-data loss <= {target_loss:g} (median, min-max)",
           title="time to a target loss (hatched: one worker slower)")
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
        async_result = ps.train_async(**common, steps=300)
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
               title="controlled staleness: delay k, one learning rate")
    fig.tight_layout()
    return fig


STRAGGLER_STALENESS = (6, 7, 8)  # exercise 3: 2 fast workers x 4 updates, less the ties
MOMENTUM_DELAYS = (0, 1, 2, 4)  # exercise 1: the delays to choose from
MOMENTUM_LARGEST_DELAY = 0  # exercise 1: momentum 0.9 at 0.02 converges at 0, diverges at 1


def check_exercise(number: int, answer) -> str:
    """The chapter's exercise checks: ``"not answered yet"`` for ``None`` or ``...``, else
    whether ``answer`` is right. Deterministic: no timing decides a verdict.

    1: the largest delay of ``MOMENTUM_DELAYS`` at which Keras's SGD with momentum 0.9 at
    learning rate 0.02 still ends below loss 0.5 in 300 ``train_delayed`` updates on
    ``toy_problem()`` (an int; tests/course/test_sync_async.py runs the fact); 2: which hurts
    more at learning rate 0.02, a constant delay of 8 or random delays with mean 8
    (``staleness.delay_schedule``): ``"constant"`` or ``"random"``; 3: about how many updates
    stale the gradients of a worker 4x slower than the two others are in async training (an
    int)."""
    checks.one_of("number", number, (1, 2, 3))
    if answer is None or answer is ...:
        return f"exercise {number}: not answered yet"
    if number == 1:
        if isinstance(answer, bool) or answer not in MOMENTUM_DELAYS:
            return f"exercise 1: answer one of the delays {MOMENTUM_DELAYS}"
        if answer == MOMENTUM_LARGEST_DELAY:
            return ("exercise 1: correct: even a delay of 1 diverges. Momentum 0.9 keeps "
                    "applying each gradient over the following updates, about 1 / (1 - 0.9) = 10 "
                    "times in all, so the parameters move about 10 times further during a delay "
                    "than with plain SGD at the same rate")
        return ("exercise 1: not quite: run delay 1 and look at its loss curve. How far do the "
                "parameters move during one delay when every gradient keeps acting for about "
                "1 / (1 - 0.9) updates?")
    if number == 2:
        if answer not in ("constant", "random"):
            return 'exercise 2: answer "constant" or "random"'
        if answer == "constant":
            return "exercise 2: correct"
        return ("exercise 2: not quite: run both; most random delays are shorter than their "
                "mean, and they differ from update to update")
    if isinstance(answer, bool) or not isinstance(answer, int | np.integer):
        return "exercise 3: answer a whole number of updates"
    if answer in STRAGGLER_STALENESS:
        return "exercise 3: correct"
    if answer < min(STRAGGLER_STALENESS):
        return ("exercise 3: not quite: count the updates of BOTH fast workers while the "
                "straggler computes one gradient")
    return "exercise 3: not quite: how many steps does a fast worker finish in 4 step times?"


RACE_METHODS = ("read_then_assign", "apply", "apply_locked", "sparse_apply",
                "sparse_apply_locked")
ROW = 64  # elements per row of the table the sparse methods update


def race_increments(device: str, method: str = "apply", threads: int = 3, repeats: int = 100,
                    size: int = 1 << 16) -> dict[str, float]:
    """``threads`` threads each add 1 to every element of one shared float32 variable of ``size``
    elements on ``device`` (a table of ``size / 64`` rows of 64), ``repeats`` times, without
    any Python lock. ``method``:

    * ``read_then_assign`` reads the variable, adds 1 and assigns the result: two ops, and
      another thread's addition between them is overwritten.
    * ``apply`` / ``apply_locked``: one dense ``ResourceApplyGradientDescent`` with
      ``use_locking`` False / True. A dense update of a resource variable takes the variable's
      exclusive lock whatever ``use_locking`` says (``ApplyGradientDescentOp`` in
      ``tensorflow/core/kernels/training_ops.cc`` passes ``sparse = false`` to
      ``MaybeLockVariableInputMutexesInOrder``, ``training_op_helpers.h``, which takes a
      ``mutex_lock`` when ``!sparse || do_lock``): nothing is lost either way.
    * ``sparse_apply`` / ``sparse_apply_locked``: one
      ``ResourceSparseApplyProximalGradientDescent`` on every row (``l1 = l2 = 0``: plain SGD
      on the rows), ``use_locking`` False / True. A sparse update takes only a shared lock
      unless ``use_locking=True``, so two threads can update the same rows at once and one
      addition can overwrite another: Hogwild's race, on an embedding table.

    Returns ``expected`` (each element's value if no addition was lost), ``lowest`` (the
    smallest element) and ``lost`` (missing additions, averaged over the elements)."""
    checks.one_of("method", method, RACE_METHODS)
    checks.positive_int("threads", threads)
    checks.positive_int("repeats", repeats)
    checks.positive_int("size", size)
    sparse = method.startswith("sparse")
    if sparse and size % ROW:
        raise ValueError(f"size must be a multiple of {ROW} for {method!r} (rows of {ROW}), "
                         f"got {size}")
    shape = [size // ROW, ROW] if sparse else [size]
    with tf.device(device):
        var = tf.Variable(tf.zeros(shape))
        minus_one, one, zero = tf.fill(shape, -1.0), tf.constant(1.0), tf.constant(0.0)
        rows = tf.range(shape[0])

    def work():
        for _ in range(repeats):
            if method == "read_then_assign":
                var.assign(var.read_value() + one)
            elif sparse:
                tf.raw_ops.ResourceSparseApplyProximalGradientDescent(
                    var=var.handle, alpha=one, l1=zero, l2=zero, grad=minus_one, indices=rows,
                    use_locking=method == "sparse_apply_locked")
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
