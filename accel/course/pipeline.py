"""Chapter 10's experiments: pipelines of dense layers on logical devices, the bubble measured
against its formula, unbalanced stages, the ``python -m accel bench pipeline`` benchmark and the
chapter's figures.

Measurements need one intra-op thread per process (two stages on two cores can then truly
overlap): the chapter sets its process up that way; the benchmark, which shares its process with
the others, measures in a fresh Python (``accel.procs.run_python``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import checks, procs, timing, viz
from accel.parallel import pipeline as pl
from accel.parallel import pipeline_exec as pe
from accel.parallel.layers import dense, linear
from accel.training import squared_error

__all__ = ["dense_stages", "square_stages", "one_device_step", "make_batch", "measure_bubble",
           "stage_phase_times", "measure_fresh", "layer_times", "bench", "figure_schedules",
           "figure_bubble", "check_exercise"]


def _enough_devices(num_stages: int, devices: Sequence[str]) -> None:
    if num_stages > len(devices):
        raise ValueError(f"{num_stages} stages need {num_stages} devices, got {len(devices)}: "
                         f"{list(devices)}")


def dense_stages(params: Sequence, balance: Sequence[int], devices: Sequence[str]):
    """The MLP of ``accel.models.mlp_init`` (``[w0, b0, w1, b1, ...]``) cut by ``balance`` (in
    layers), part ``s`` on ``devices[s]``: ReLU after every layer but the last
    (``pipeline_exec.layer_stages`` on ``accel.parallel.layers``' dense and linear layers)."""
    n = len(params) // 2
    layers = [(dense if k < n - 1 else linear, params[2 * k:2 * k + 2]) for k in range(n)]
    return pe.layer_stages(layers, balance, devices)


def square_stages(devices: Sequence[str], balance: Sequence[int], width: int = 512,
                  seed: int = 0):
    """Stages of ``width`` x ``width`` ReLU layers (``balance[s]`` of them on stage ``s``): equal
    work per layer, so a stage's time is proportional to its number of layers."""
    rng = np.random.default_rng(seed)
    _enough_devices(len(balance), devices)
    stages = []
    for count, device in zip(balance, devices[:len(balance)], strict=True):
        with tf.device(device):
            ws = [tf.Variable(rng.normal(0, width**-0.5, (width, width)).astype(np.float32))
                  for _ in range(count)]

        def fn(p, x):
            for w in p:
                x = tf.nn.relu(tf.matmul(x, w))
            return x

        stages.append(pe.Stage(fn, ws, device))
    return stages


def one_device_step(stages, x, y):
    """A callable running the same layers' forward and backward on the first stage's device,
    on the whole batch (the baseline of a pipeline's speed-up)."""
    variables = [v for st in stages for v in st.params]

    def run():
        with tf.device(stages[0].device), tf.GradientTape() as tape:
            h = x
            for st in stages:
                h = st.fn(st.params, h)
            loss = tf.reduce_mean(squared_error(y, h))
        return [g.numpy() for g in tape.gradient(loss, variables)][:1]

    return run


def make_batch(m: int, microbatch: int = 64, width: int = 512):
    """A reproducible batch of ``m`` micro-batches of ``microbatch`` rows for ``square_stages``."""
    rng = np.random.default_rng(m)
    return (tf.constant(rng.normal(size=(m * microbatch, width)).astype(np.float32)),
            tf.zeros((m * microbatch, width)))


def measure_bubble(devices: Sequence[str], microbatches: Sequence[int] = (1, 2, 4, 8, 16),
                   balance: Sequence[int] = (4, 4), width: int = 512, microbatch: int = 128,
                   repeat: int = 2, schedule: str = "gpipe") -> dict:
    """Run the pipeline of ``square_stages`` for each number of micro-batches (fixed micro-batch
    size) and return, per ``m``: the measured idle fraction of each device (median over
    ``repeat`` runs), the formula's, the step time (first task start to last task end), the peak
    stash per stage, the median task times, and two baselines on one device: the same
    micro-batches through all layers (``one_device_s``) and the whole batch at once
    (``whole_batch_s``). Every side gets one warm-up run; the pipeline and its baselines take
    turns, ``repeat`` times, so a load that comes and goes hits all of them; each step time is
    the best of its runs (interference only adds time, so the shortest run is the steadiest
    estimate of what each side can do: with the median of two, one micro-batch, which cannot
    overlap, showed "speed-ups" from 0.85x to 1.17x on a quiet machine)."""
    make = {"gpipe": pl.gpipe_schedule, "1f1b": pl.one_f_one_b_schedule}[schedule]
    stages = square_stages(devices[:len(balance)], balance, width)
    one = square_stages(devices[:1], [sum(balance)], width)  # the same layers on one device
    p, out = len(balance), {}
    for m in microbatches:
        x, y = make_batch(m, microbatch, width)
        sched = make(m, p)
        alone_sched = pl.gpipe_schedule(m, 1)
        pe.run_schedule(stages, sched, x, y, squared_error, m)  # warm-up, both sides
        pe.run_schedule(one, alone_sched, x, y, squared_error, m)
        whole_step = one_device_step(stages, x, y)
        whole_step()
        runs, alone, whole = [], [], []
        for _ in range(repeat):
            runs.append(pe.run_schedule(stages, sched, x, y, squared_error, m))
            alone.append(pe.run_schedule(one, alone_sched, x, y, squared_error, m))
            whole.append(timing.time_fn(whole_step, repeat=1, warmup=0))
        idle = np.median([pe.measured_idle_fractions(r) for r in runs], axis=0)
        out[m] = {"measured": [float(v) for v in idle], "formula": pl.bubble_fraction(m, p),
                  "step_s": min(_span(r) for r in runs), "peak_stash": runs[-1].peak_stash,
                  "task_s": _task_times(runs[-1]),
                  "one_device_s": min(_span(r) for r in alone),
                  "whole_batch_s": min(whole)}
    return out


def _span(run) -> float:
    """First task start to last task end of a run."""
    return (max(e for log in run.log for *_, e in log)
            - min(s for log in run.log for _, s, _ in log))


def stage_phase_times(run) -> dict[tuple[int, str], float]:
    """Median seconds of each stage's forward and backward tasks in a run:
    ``{(stage, "F"): ..., (stage, "B"): ...}`` (what ``pipeline.simulate`` can replay)."""
    times: dict[tuple[int, str], list[float]] = {}
    for log in run.log:
        for (stage, _, phase), start, end in log:
            times.setdefault((stage, phase), []).append(end - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def _task_times(run) -> dict[str, float]:
    """Median forward and backward task time over all stages of a run."""
    times = {"F": [], "B": []}
    for log in run.log:
        for (_, _, phase), start, end in log:
            times[phase].append(end - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def layer_times(stages, x, repeat: int = 5) -> list[float]:
    """Median forward + backward seconds of each layer of ``square_stages`` alone: the costs a
    time-based balance (``partition.balance_by_cost``) splits."""
    out = []
    for st in stages:
        for w in st.params:
            def one(w=w, device=st.device):
                with tf.device(device), tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.nn.relu(tf.matmul(x, w))
                return tape.gradient(y, [x, w])[1].numpy()
            out.append(timing.time_fn(one, repeat=repeat))
    return out


_FRESH = """
import json
from accel import devices
from accel.course import pipeline as cp
names = devices.setup(2, intra_op_threads=1)
print("RESULT" + json.dumps({{s: cp.measure_bubble(names, schedule=s, **{kwargs!r})
                              for s in {schedules!r}}}))
"""


def measure_fresh(schedules: Sequence[str] = ("gpipe", "1f1b"), **kwargs) -> dict:
    """``{schedule: measure_bubble(..., schedule=schedule, **kwargs)}`` for each schedule, all
    in one fresh Python with 2 logical devices and one intra-op thread."""
    for s in schedules:
        checks.one_of("schedule", s, ("gpipe", "1f1b"))
    out = procs.run_python(_FRESH.format(schedules=tuple(schedules), kwargs=kwargs),
                           timeout=600, warm=True)
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    return {s: {int(m): r for m, r in res.items()} for s, res in json.loads(line[6:]).items()}


def bench(device_names: Sequence[str], quick: bool = False) -> dict:
    """``python -m accel bench pipeline``: the bubble for m = 1..16 against the formula, 1F1B vs
    GPipe step time and stash, pipeline vs one device; measured in a fresh 2-device process
    with one intra-op thread, next to this machine's 2-thread ceiling."""
    ms = (1, 4) if quick else (1, 2, 4, 8, 16)
    kw = dict(microbatches=ms, repeat=1 if quick else 3, width=128 if quick else 512)
    both = measure_fresh(("gpipe", "1f1b"), **kw)
    gpipe, ofob = both["gpipe"], both["1f1b"]
    print("m   measured idle  (p-1)/(m+p-1)  difference  1F1B/GPipe step  stash GPipe/1F1B  "
          "speed-up vs 1 device (same micro-batches / whole batch)")
    for m in ms:
        got, want = float(np.mean(gpipe[m]["measured"])), gpipe[m]["formula"]
        print(f"{m:<3d} {got:13.3f}  {want:13.3f}  {got - want:+10.3f}  "
              f"{ofob[m]['step_s'] / gpipe[m]['step_s']:15.2f}  "
              f"{max(gpipe[m]['peak_stash']):>11d}/{max(ofob[m]['peak_stash'])}  "
              f"{gpipe[m]['one_device_s'] / gpipe[m]['step_s']:19.2f}x / "
              f"{gpipe[m]['whole_batch_s'] / gpipe[m]['step_s']:.2f}x")
    measured = timing.measure_ceiling()
    print(timing.ceiling_line(measured))
    return {"gpipe": gpipe, "1f1b": ofob, "ceiling": measured.value}


def measure_keras_bubble(devices: Sequence[str], microbatches: Sequence[int] = (2, 4, 8, 16),
                         schedules: Sequence[tuple[str, int]] = (("1f1b", 1),
                                                                 ("interleaved", 2)),
                         layers: int = 8, width: int = 512, microbatch: int = 128,
                         repeat: int = 3) -> dict:
    """The idle share of a Keras ``Sequential`` (``layers`` Dense ReLU layers of ``width``)
    trained by ``pipeline_exec.Pipeline`` on ``devices`` (p of them), for each schedule
    ``(name, num_chunks)`` and number of micro-batches (fixed micro-batch size): measured (mean
    over devices, from each device's busy intervals; the best of ``repeat`` runs after one
    warm-up, interference only adding idle time) next to (p-1)/(vm+p-1), and the median
    forward task time (the goal: at least 10 ms, so that Python's per-task cost is small)."""
    import keras

    from accel.parallel.pipeline_exec import Pipeline

    p = len(devices)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))]
                             + [keras.layers.Dense(width, activation="relu")
                                for _ in range(layers)])
    out: dict = {}
    for name, chunks in schedules:
        rows = {}
        for m in microbatches:
            if name == "interleaved" and m % p:
                continue
            pipe = Pipeline(model, devices, loss="mse", optimizer="sgd", num_microbatches=m,
                            schedule=name, num_chunks=chunks)
            x, y = make_batch(m, microbatch, width)
            pipe.train_step(x, y)  # warm-up
            runs = [pipe.train_step(x, y) for _ in range(repeat)]
            idle = [float(np.mean(pe.measured_idle_fractions(r))) for r in runs]
            rows[m] = {"measured": min(idle), "formula": pl.bubble_fraction(m, p, chunks),
                       "task_s": _task_times(runs[-1]), "step_s": min(_span(r) for r in runs)}
        out[f"{name} v={chunks}"] = rows
    return out


_FRESH_KERAS = """
import json
import accel.course  # noqa: F401
from accel import devices
from accel.course import pipeline as cp
names = devices.setup(2, intra_op_threads=1)
print("RESULT" + json.dumps(cp.measure_keras_bubble(names, **{kwargs!r})))
"""


def bench_keras(device_names: Sequence[str], quick: bool = False) -> dict:
    """``python -m accel bench keras-pipeline``: a Keras model pipelined on 2 devices (one
    intra-op thread each, a fresh process): the measured idle share of 1F1B and interleaved 1F1B
    (v = 2) against (p-1)/(vm+p-1) for m = 2..16, next to this machine's ceiling."""
    kw = dict(microbatches=(2,) if quick else (2, 4, 8, 16), repeat=1 if quick else 3,
              width=32 if quick else 512, layers=4 if quick else 8, microbatch=8 if quick else 128)
    out = procs.run_python(_FRESH_KERAS.format(kwargs=kw), timeout=600, warm=True)
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    result = {k: {int(m): r for m, r in v.items()} for k, v in json.loads(line[6:]).items()}
    print("schedule        m   measured idle  formula  difference  forward task (ms)  step (ms)")
    for name, rows in result.items():
        for m, r in rows.items():
            print(f"{name:14s} {m:3d}  {r['measured']:13.3f}  {r['formula']:7.3f}  "
                  f"{r['measured'] - r['formula']:+10.3f}  {r['task_s']['F'] * 1e3:17.1f}  "
                  f"{r['step_s'] * 1e3:9.1f}")
    both = [m for m in result.get("1f1b v=1", {}) if m in result.get("interleaved v=2", {})]
    for m in both:
        a, b = result["interleaved v=2"][m]["measured"], result["1f1b v=1"][m]["measured"]
        print(f"m={m}: interleaved idle / 1F1B idle = {a / b:.2f} (formula "
              f"{pl.bubble_fraction(m, 2, 2) / pl.bubble_fraction(m, 2):.2f})")
    measured = timing.measure_ceiling()
    print(timing.ceiling_line(measured))
    return {"results": result, "ceiling": measured.value}


def figure_schedules(num_microbatches: int = 8, num_stages: int = 4):
    """GPipe and 1F1B on the clock, one row per stage (pure schedule data, no measurement)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True)
    for ax, (name, make) in zip(axes, (("GPipe", pl.gpipe_schedule),
                                       ("1F1B", pl.one_f_one_b_schedule)), strict=True):
        schedule = make(num_microbatches, num_stages)
        bars = [(f"stage {s}", t, t + 1, f"{ph}{mb}") for t, tasks in enumerate(schedule)
                for s, mb, ph in tasks]
        viz.timeline(bars, ax=ax, title=f"{name}: {num_stages} stages, {num_microbatches} "
                     f"micro-batches, idle {pl.idle_fraction(schedule, num_stages):.0%}",
                     xlabel="clock tick")
    fig.tight_layout()
    return fig


def figure_bubble(results: dict, num_stages: int = 2):
    """Measured idle fraction against (p-1)/(m+p-1), from ``measure_bubble``'s result."""
    import matplotlib.pyplot as plt

    ms = sorted(results)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    fine = np.arange(1, max(ms) + 1)
    ax.plot(fine, [pl.bubble_fraction(m, num_stages) for m in fine], "--", color="grey",
            label="(p-1)/(m+p-1)")
    ax.plot(ms, [np.mean(results[m]["measured"]) for m in ms], "o-", label="measured")
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="idle fraction", xticks=ms,
           xticklabels=[str(m) for m in ms], title=f"the bubble, {num_stages} stages")
    ax.legend()
    fig.tight_layout()
    return fig


def check_exercise(number: int, answer) -> str:
    """The chapter's exercise checks: ``"not answered yet"`` for ``None``, else whether
    ``answer`` is right. 1: the bubble fraction of 8 stages and 32 micro-batches (a number);
    2: a schedule (list of ticks) for 2 stages and 3 micro-batches that ``validate_schedule``
    accepts and whose first stage holds at most 2 micro-batches; 3: the fewest micro-batches
    that keep an 8-stage pipeline at least 90% busy."""
    checks.one_of("number", number, (1, 2, 3))
    if answer is None:
        return f"exercise {number}: not answered yet"
    if number == 1:
        ok = isinstance(answer, float | int) and abs(answer - pl.bubble_fraction(32, 8)) < 1e-9
    elif number == 2:
        try:
            pl.validate_schedule(answer, 2, 3)
            ok = pl.peak_in_flight(answer, 2)[0] <= 2
        except (ValueError, TypeError):
            ok = False
    else:
        ok = answer == next(m for m in range(1, 1000) if m / (m + 7) >= 0.9)
    return f"exercise {number}: " + ("correct" if ok else "not quite, try again")
