"""Chapter 10's experiments: pipelines of dense layers on logical devices, the bubble measured
against its formula, unbalanced stages, the ``python -m accel bench pipeline`` benchmark and the
chapter's figures.

Measurements need one intra-op thread per process (two stages on two cores can then truly
overlap): the chapter sets its process up that way; the benchmark, which shares its process with
the others, measures in a fresh Python (``accel.procs.run_python``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from accel import checks, procs, timing, viz
from accel.parallel import pipeline as pl
from accel.parallel import pipeline_exec as pe
from accel.parallel.layers import dense, linear
from accel.training import squared_error

__all__ = ["dense_stages", "square_stages", "make_batch", "measure_bubble",
           "stage_phase_times", "measure_fresh", "layer_times", "bench", "figure_schedules",
           "figure_bubble", "check_exercise", "overhead_model", "measure_overhead",
           "overhead_report", "bench_overhead", "format_timeline", "replay_idle", "handoff_gaps",
           "dependency_check", "overlap_share", "count_messages", "skip_model", "ResidualDense",
           "residual_mlp", "keras_reference", "max_relative_difference", "waiting_stages",
           "measure_waiting_bubble"]


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
                  seed: int = 0, traced: bool = False):
    """Stages of ``width`` x ``width`` ReLU layers (``balance[s]`` of them on stage ``s``): equal
    work per layer, so a stage's time is proportional to its number of layers. ``traced``: each
    stage's function is one ``tf.function`` (one call per task instead of one Python dispatch
    per op: the executor's per-task overhead cut)."""
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

        stages.append(pe.Stage(tf.function(fn, autograph=False) if traced else fn, ws, device))
    return stages


def make_batch(m: int, microbatch: int = 64, width: int = 512):
    """A reproducible batch of ``m`` micro-batches of ``microbatch`` rows for ``square_stages``."""
    rng = np.random.default_rng(m)
    return (tf.constant(rng.normal(size=(m * microbatch, width)).astype(np.float32)),
            tf.zeros((m * microbatch, width)))


def _timed_run(stages, schedule, x, y, m):
    """``(wall seconds, run)`` of one ``run_schedule`` call: the clock every side of a
    comparison is read by (the call from entry to return, threads started and joined)."""
    start = time.perf_counter()
    run = pe.run_schedule(stages, schedule, x, y, squared_error, m)
    return time.perf_counter() - start, run


def _busy(run) -> float:
    """Seconds the run's devices were busy, summed over devices."""
    return sum(e - s for log in run.log for _, s, e in log)


def measure_bubble(devices: Sequence[str], microbatches: Sequence[int] = (1, 2, 4, 8, 16),
                   balance: Sequence[int] = (4, 4), width: int = 512, microbatch: int = 128,
                   repeat: int = 2, schedule: str = "gpipe", traced: bool = True,
                   baselines: Sequence[int] | None = None) -> dict:
    """Run the pipeline of ``square_stages`` for each number of micro-batches (fixed micro-batch
    size) and return, per ``m``, figures that all come from ONE pipeline run, the fastest of
    ``repeat`` (``run``): ``step_s``, its time from call to return; ``measured``, each device's
    idle share read from the busy intervals it logged; ``replay``, the same run replayed by
    ``pipeline.simulate`` from each task's own logged duration, in the order each device ran
    them, with no time between tasks (``replay_idle``): what separates it from ``measured`` is
    the executor's hand-offs; ``gap_ms``, the mean time a task of that run waited after it could
    have started (an event set, a thread woken, Python's interpreter lock taken:
    ``handoff_gaps``); ``task_s``, that run's median task time per phase; ``peak_stash``; and
    ``formula``, the schedule's bubble.

    Baselines on one device, the same layers as one stage: the same micro-batches one after
    another (``one_device_s``) and the whole batch as one micro-batch (``whole_batch_s``), each
    the fastest of its runs. One clock for every side: each side is one ``run_schedule`` call of
    the same executor, timed from entry to return (``_timed_run``), so at ``m = 1`` the three
    sides run the same work. Every side gets one warm-up run; the sides take turns, ``repeat``
    times, so a load that comes and goes hits all of them. ``busy_s`` and ``one_busy_s``: the
    seconds the devices were busy, summed over devices, in the pipeline's run and in the
    one-device run on the same micro-batches: their ratio is how much longer the same tasks took
    when two devices ran at once (which an idle share read from busy intervals counts as busy).
    ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"zb-h1"``. ``baselines``: the ``m`` whose
    one-device baselines are timed (default all; the others get ``None``)."""
    checks.one_of("schedule", schedule, ("gpipe", "1f1b", "zb-h1"))
    stages = square_stages(devices[:len(balance)], balance, width, traced=traced)
    one = square_stages(devices[:1], [sum(balance)], width, traced=traced)  # on one device
    p, out = len(balance), {}
    for m in microbatches:
        x, y = make_batch(m, microbatch, width)
        sides = {"pipe": (stages, pl.make_schedule(schedule, m, p), m)}
        if baselines is None or m in baselines:
            sides["alone"] = (one, pl.gpipe_schedule(m, 1), m)
            sides["whole"] = (one, pl.gpipe_schedule(1, 1), 1)
        for st, sched, k in sides.values():  # the same warm-up for every side
            _timed_run(st, sched, x, y, k)
        timed: dict[str, list] = {side: [] for side in sides}
        for _ in range(repeat):
            for side, (st, sched, k) in sides.items():
                timed[side].append(_timed_run(st, sched, x, y, k))
        wall, best = min(timed["pipe"], key=lambda t: t[0])  # every figure below from it
        alone = min(timed["alone"], key=lambda t: t[0]) if "alone" in timed else None
        out[m] = {"measured": [float(v) for v in pe.measured_idle_fractions(best)],
                  "formula": pl.bubble_fraction(m, p, schedule=schedule)
                  if schedule != "zb-h1" or m >= p else None,
                  "replay": float(np.mean(replay_idle(best))),
                  "gap_ms": float(np.mean(handoff_gaps(best))) * 1e3,
                  "step_s": wall, "peak_stash": best.peak_stash,
                  "task_s": _task_times(best), "busy_s": _busy(best),
                  "one_busy_s": _busy(alone[1]) if alone else None,
                  "one_device_s": alone[0] if alone else None,
                  "whole_batch_s": min(t for t, _ in timed["whole"]) if alone else None,
                  "run": best}
    return out


def replay_idle(run, num_stages: int | None = None) -> list[float]:
    """Each device's idle share of ``run`` replayed by ``pipeline.simulate`` from every task's
    own measured duration, in the order the device ran them: the bubble the task times alone
    explain, without the time between tasks."""
    durations = {task: end - start for log in run.log for task, start, end in log}
    replay = pl.simulate(run.orders(), durations.__getitem__, num_stages)
    return pl.interval_idle_fractions(replay)


def handoff_gaps(run, num_stages: int | None = None) -> list[float]:
    """For every task but a device's first with nothing to wait for, the seconds between the
    moment it could start (its dependencies and its device's previous task ended) and its
    start: the executor's hand-off (an event set, a thread woken, Python's lock taken)."""
    p = num_stages or max(t[0] for log in run.log for t, _, _ in log) + 1
    end = {task: e for log in run.log for task, _, e in log}
    gaps = []
    for log in run.log:
        previous = []
        for task, start, stop in log:
            ready = [end[d] for d in pl.dependencies(task, p)] + previous
            if ready:
                gaps.append(start - max(ready))
            previous = [stop]
    return gaps


def dependency_check(run, num_stages: int) -> tuple[int, int]:
    """``(checked, violated)``: the dependencies of ``run`` that cross stages (the forward of
    ``i`` on stage ``s + 1`` after it on ``s``, the backward of ``i`` on ``s`` after it on
    ``s + 1``), checked on the recorded start and end times. A backward's dependence on its own
    forward (same stage, same device) is left out: the device's own order already keeps it."""
    start = {task: s for log in run.log for task, s, _ in log}
    end = {task: e for log in run.log for task, _, e in log}
    pairs = [(d, task) for task in start for d in pl.dependencies(task, num_stages)
             if d[0] != task[0]]
    return len(pairs), sum(start[task] < end[d] for d, task in pairs)


def overlap_share(run) -> float:
    """The share of the run's span during which at least two devices were busy at once."""
    events = sorted([(s, 1) for log in run.log for _, s, _ in log]
                    + [(e, -1) for log in run.log for _, _, e in log])
    busy, both, last = 0, 0.0, events[0][0]
    for t, step in events:
        if busy >= 2:
            both += t - last
        busy, last = busy + step, t
    return both / _span(run)


def device_peak_stash(schedule, num_stages: int, num_devices: int) -> list[float]:
    """For each device, the most activations it holds at once, in micro-batches of the whole
    device's layers: a virtual stage (stage ``s`` on device ``s % num_devices``) holds
    ``num_devices / num_stages`` of them, so a chunk's micro-batch counts that share. Counted
    tick by tick on ``schedule`` (a forward adds its chunk, the task that frees it, ``B`` or
    ``W`` where the schedule holds W tasks, removes it); with one stage per device it is
    ``pipeline.peak_in_flight``."""
    checks.positive_int("num_stages", num_stages)
    checks.positive_int("num_devices", num_devices)
    if num_stages % num_devices:
        raise ValueError(f"num_stages={num_stages} must be a multiple of "
                         f"num_devices={num_devices}")
    share = num_devices / num_stages
    release = "W" if pl.splits_backward(schedule) else "B"
    held, peak = [0.0] * num_devices, [0.0] * num_devices
    for tasks in schedule:
        for stage, _, phase in tasks:
            d = stage % num_devices
            held[d] += share if phase == "F" else -share if phase == release else 0.0
            peak[d] = max(peak[d], held[d])
    return peak


def count_messages(schedule, num_devices: int, num_stages: int | None = None) -> int:
    """Tensors that cross devices in one batch: each task whose input comes from a stage on
    another device (a forward's activation from stage ``s - 1``, a backward's gradient from
    stage ``s + 1``)."""
    n = num_stages or 1 + max(t[0] for tick in schedule for t in tick)
    return sum(1 for tick in schedule for task in tick for d in pl.dependencies(task, n)
               if d[0] != task[0] and d[0] % num_devices != task[0] % num_devices)


class ResidualDense(keras.layers.Layer):
    """``x + Dense(ReLU(Dense(x)))``: a residual block as one Keras layer, so that a
    ``Sequential`` of them is a stack of residual blocks (a pipeline takes layers in order)."""

    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.inner = keras.layers.Dense(width, activation="relu", dtype=self.dtype_policy)
        self.outer = keras.layers.Dense(width, dtype=self.dtype_policy)

    def call(self, x, training=False):
        return x + self.outer(self.inner(x))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def residual_mlp(inputs: int = 8, width: int = 16, blocks: int = 4, outputs: int = 1,
                 seed: int = 0, dtype: str = "float64"):
    """A Keras ``Sequential``: Dense(``width``), ``blocks`` residual blocks, Dense(``outputs``)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((inputs,), dtype=dtype),
                             keras.layers.Dense(width, dtype=dtype)]
                            + [ResidualDense(width, dtype=dtype) for _ in range(blocks)]
                            + [keras.layers.Dense(outputs, dtype=dtype)])


def keras_reference(model, x, y, lr: float, batch_size: int, epochs: int):
    """A copy of ``model`` trained by Keras's own ``fit`` on one device (plain SGD, in order):
    ``(copy, history)``, the reference a pipeline must equal."""
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    floatx = keras.config.floatx()
    keras.config.set_floatx(ref.dtype)  # Keras's loss and metrics in the model's precision
    try:
        ref.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
        history = ref.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    finally:
        keras.config.set_floatx(floatx)
    return ref, history


def max_relative_difference(a: Sequence, b: Sequence) -> float:
    """max |a - b| over all arrays, divided by max |b|."""
    scale = max(float(np.max(np.abs(np.asarray(v)))) for v in b)
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in
               zip(a, b, strict=True)) / scale


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
    """Median forward and backward (and, where the run split it, weight-gradient) task time
    over all stages of a run, leaving out the micro-batches whose forward ran inside their
    backward (``run.deferred``: an F that only kept its input, a B that did both), unless
    every micro-batch's was (one stage)."""
    times: dict[str, list[float]] = {}
    tasks = [entry for log in run.log for entry in log]
    alone = [e for e in tasks if e[0][:2] not in run.deferred] or tasks
    for (_, _, phase), start, end in alone:
        times.setdefault(phase, []).append(end - start)
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
results = {{s: cp.measure_bubble(names, schedule=s, **{kwargs!r}) for s in {schedules!r}}}
print("RESULT" + json.dumps({{s: {{m: {{k: v for k, v in r.items() if k != "run"}}
                                  for m, r in res.items()}} for s, res in results.items()}}))
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


def skip_model(layers: int = 8, width: int = 512):
    """A functional model: ``layers`` Dense ReLU layers of ``width`` in a chain, the first
    one's output added to the last one's (a skip connection across every cut of the chain)."""
    import keras

    inputs = keras.Input((width,))
    first = h = keras.layers.Dense(width, activation="relu")(inputs)
    for _ in range(layers - 1):
        h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Add()([first, h]))


def measure_keras_bubble(devices: Sequence[str], microbatches: Sequence[int] = (2, 4, 8, 16),
                         schedules: Sequence[tuple[str, int]] = (("1f1b", 1),
                                                                 ("interleaved", 2)),
                         layers: int = 8, width: int = 512, microbatch: int = 128,
                         repeat: int = 3, functional: bool = False) -> dict:
    """The idle share of a Keras ``Sequential`` (``layers`` Dense ReLU layers of ``width``;
    ``functional``: the same layers in a functional model whose first layer's output also
    skips to the end, added to the last one's, so it crosses every cut: ``skip_model``)
    trained by ``pipeline_exec.Pipeline`` on ``devices`` (p of them), for each schedule
    ``(name, num_chunks)`` and number of micro-batches (fixed micro-batch size): measured (mean
    over devices, from each device's busy intervals; the best of ``repeat`` runs after one
    warm-up, interference only adding idle time) next to (p-1)/(vm+p-1), the same run
    replayed from its tasks' own durations (``replay_idle``: what unequal task times explain;
    the rest is the executor's hand-offs), the median task times per phase (F, B and, for
    ``"zb-h1"``, W), the step time (the best of the runs, each timed from the call of
    ``run_step`` to its return: the same clock for every schedule) and the examples per
    second it gives."""
    import keras

    from accel.parallel.pipeline_exec import Pipeline

    p = len(devices)
    keras.utils.set_random_seed(0)
    model = skip_model(layers, width) if functional else keras.Sequential(
        [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu")
                                   for _ in range(layers)])
    out: dict = {}
    for name, chunks in schedules:
        rows = {}
        for m in microbatches:
            if name == "interleaved" and m % p:
                continue
            # by parameter bytes, the functional model's weightless Add joins the last stage:
            # every stage holds the same Dense layers, as the Sequential's count gives
            pipe = Pipeline(model, devices, loss="mse", optimizer="sgd", num_microbatches=m,
                            schedule=name, num_chunks=chunks,
                            balance="bytes" if functional else "count")
            x, y = make_batch(m, microbatch, width)
            pipe.run_step(x, y)  # warm-up
            runs, walls = [], []
            for _ in range(repeat):  # each step timed from the call to its return
                start = time.perf_counter()
                runs.append(pipe.run_step(x, y))
                walls.append(time.perf_counter() - start)
            idle = [float(np.mean(pe.measured_idle_fractions(r))) for r in runs]
            best = runs[int(np.argmin(idle))]
            kind = "zb-h1" if name == "zb-h1" else "1f1b"
            rows[m] = {"measured": min(idle),
                       "formula": pl.bubble_fraction(m, p, chunks, schedule=kind),
                       "replay": float(np.mean(replay_idle(best, p * chunks))),
                       "task_s": _task_times(runs[-1]), "step_s": min(walls),
                       "examples_s": m * microbatch / min(walls)}
        out[f"{name} v={chunks}"] = rows
    return out


def waiting_stages(devices: Sequence[str], forward_ms: float, width: int = 4) -> list:
    """One stage per device in ``devices`` (repeat a device for virtual stages) whose work holds
    no core: its forward waits ``forward_ms`` and its backward twice that (``time.sleep``,
    which releases Python's lock, as a host thread waiting on a GPU kernel does), around a
    ``width`` x ``width`` matmul that carries the data and the gradients through."""
    def waiting(ms):
        @tf.custom_gradient
        def wait(x):
            time.sleep(ms / 1e3)

            def grad(dy):
                time.sleep(2 * ms / 1e3)
                return dy
            return tf.identity(x), grad
        return wait

    wait = waiting(forward_ms)
    stages = []
    for device in devices:
        with tf.device(device):
            w = tf.Variable(tf.eye(width))
        stages.append(pe.Stage(fn=lambda params, x: wait(tf.matmul(x, params[0])),
                               params=[w], device=device))
    return stages


def measure_waiting_bubble(devices: Sequence[str], microbatches: Sequence[int] = (2, 4, 8, 16),
                           forward_ms: float = 10.0, repeat: int = 3) -> dict:
    """The executor's own bubble: 1F1B on ``devices`` and interleaved 1F1B (v = 2, each virtual
    stage half the wait) with ``waiting_stages``, whose tasks compete for no core, so that what
    the measured idle share (the best of ``repeat`` runs after a warm-up) adds to
    (p-1)/(vm+p-1) is the executor's: its hand-offs and its Python around each task.
    ``{"1f1b v=1" | "interleaved v=2": {m: {"measured", "formula"}}}``."""
    p, out = len(devices), {}
    for name, chunks in (("1f1b", 1), ("interleaved", 2)):
        stages = waiting_stages(list(devices) * chunks, forward_ms / chunks)
        rows = {}
        for m in microbatches:
            x = tf.ones((4 * m, 4))
            schedule = pl.make_schedule(name, m, p, chunks)
            runs = [pe.run_schedule(stages, schedule, x, x, squared_error, m)
                    for _ in range(repeat + 1)][1:]
            rows[m] = {"measured": min(float(np.mean(pe.measured_idle_fractions(r)))
                                       for r in runs),
                       "formula": pl.bubble_fraction(m, p, chunks)}
        out[f"{name} v={chunks}"] = rows
    return out


_FRESH_KERAS = """
import json
import accel.course  # noqa: F401
from accel import devices, timing
from accel.course import pipeline as cp
names = devices.setup(2, intra_op_threads=1)
result = {{kind: cp.measure_keras_bubble(names, functional=kind == "functional", **{kwargs!r})
          for kind in ("sequential", "functional")}}
result["waiting"] = cp.measure_waiting_bubble(names, **{waiting!r})
floor = timing.measure_lockstep_floor(names, {kwargs[microbatch]}, {kwargs[width]},
                                      {kwargs[layers]})
print("RESULT" + json.dumps(result) + "FLOOR" + json.dumps(floor))
"""


def _goal_line(runs: dict) -> str:
    off = sorted({(name, m) for name, rows in runs.items() for m, r in rows.items()
                  if abs(r["measured"] - r["formula"]) > 0.03})
    return (f"goal (within 0.03 of the formula, every m): "
            f"{'met' if not off else 'missed at ' + str(off)}")


def bench_keras(device_names: Sequence[str], quick: bool = False) -> dict:
    """``python -m accel bench keras-pipeline``: a Keras ``Sequential`` and a functional model
    with a skip connection across the cut (``skip_model``) pipelined on 2 devices (one
    intra-op thread each, a fresh process): the measured idle share of 1F1B and interleaved 1F1B
    (v = 2) against (p-1)/(vm+p-1) for m = 2..16, the throughput beside, interleaved against
    1F1B at the same m, and this machine's ceiling. Goal: within 0.03 of the formula. Then the
    same schedules with tasks that hold no core (``measure_waiting_bubble``: 10 ms forwards):
    the executor's own share of the idle time, apart from two devices sharing two cores. Last,
    no pipeline: two equal works in lock-step, one per device (``timing.measure_lockstep_floor``,
    as TensorFlow functions and in NumPy), what jitter alone costs devices that wait for each
    other here."""
    kw = dict(microbatches=(2,) if quick else (2, 4, 8, 16), repeat=1 if quick else 3,
              width=32 if quick else 512, layers=4 if quick else 8, microbatch=8 if quick else 128)
    waiting = dict(microbatches=kw["microbatches"], repeat=kw["repeat"],
                   forward_ms=1.0 if quick else 10.0)
    out = procs.run_python(_FRESH_KERAS.format(kwargs=kw, waiting=waiting), timeout=900,
                           warm=True)
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    line, floor = line[6:].split("FLOOR")
    result = {kind: {k: {int(m): r for m, r in v.items()} for k, v in runs.items()}
              for kind, runs in json.loads(line).items()}
    rows_per_mb = kw["microbatch"]
    for kind, runs in result.items():
        if kind == "waiting":
            continue
        print(f"{kind} model")
        print("schedule        m   measured idle  formula  difference  replayed  "
              "forward task (ms)  step (ms)  examples/s")
        for name, rows in runs.items():
            for m, r in rows.items():
                print(f"{name:14s} {m:3d}  {r['measured']:13.3f}  {r['formula']:7.3f}  "
                      f"{r['measured'] - r['formula']:+10.3f}  {r['replay']:8.3f}  "
                      f"{r['task_s']['F'] * 1e3:17.1f}  {r['step_s'] * 1e3:9.1f}  "
                      f"{m * rows_per_mb / r['step_s']:10.0f}")
        print(_goal_line(runs))
        inter, plain = runs.get("interleaved v=2", {}), runs.get("1f1b v=1", {})
        for m in [m for m in plain if m in inter]:
            idle = inter[m]["measured"] / plain[m]["measured"]
            print(f"m={m}: interleaved / 1F1B: idle {idle:.2f}"
                  f" (formula {pl.bubble_fraction(m, 2, 2) / pl.bubble_fraction(m, 2):.2f}), "
                  f"step {inter[m]['step_s'] / plain[m]['step_s']:.2f}")
    print(f"tasks that hold no core (forward {waiting['forward_ms']:g} ms, backward twice that, "
          "waited as a host thread waits on a GPU): the executor's own idle")
    for name, rows in result["waiting"].items():
        print(f"{name:14s} " + "  ".join(f"m={m}: {r['measured']:.3f} vs {r['formula']:.3f} "
                                         f"({r['measured'] - r['formula']:+.3f})"
                                         for m, r in rows.items()))
    print(_goal_line(result["waiting"]))
    floor = json.loads(floor)
    print(f"no pipeline: two equal works in lock-step, one per device ({kw['layers']} ReLU "
          f"matmuls of {kw['microbatch']} x {kw['width']}): idle {floor['tensorflow']:.3f} as "
          f"TensorFlow functions, {floor['numpy']:.3f} in NumPy (timing.measure_lockstep_floor)")
    measured = timing.measure_ceiling()
    print(timing.ceiling_line(measured))
    return {"results": result, "ceiling": measured.value, "lockstep": floor}


_OVERHEAD_FORMS = {  # every other form on one device: name -> (form, options)
    "towers (data)": ("data", {}),
    "split (model)": ("model", {}),
    "tensor": ("tensor", {"rules": {"hidden_[02]": "column", "hidden_[13]": "row"}}),
    "zero stage 1": ("zero", {"stage": 1}),
    "zero stage 3": ("zero", {"stage": 3}),
    "offload (host: device 2)": ("offload", {"host": None}),
    "accumulate x2": ("accumulate", {"accumulation_steps": 2}),
}


def overhead_model(width: int = 256, depth: int = 4, inputs: int = 64):
    """The overhead benchmark's model: Dense ``inputs -> width (ReLU) x depth -> 1``."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((inputs,))]
                            + [keras.layers.Dense(width, "relu", name=f"hidden_{k}")
                               for k in range(depth)]
                            + [keras.layers.Dense(1, name="out")])


def measure_overhead(devices_: Sequence[str], steps: int = 8, batch: int = 64, rounds: int = 5,
                     others: bool = True) -> dict:
    """Seconds per step of ``fit(epochs=1)`` over ``steps`` batches of ``batch`` (write-back
    included), the median of ``rounds`` interleaved calls, for Keras's ``fit`` on one device,
    ``Pipeline`` with p = 1, m = 1, with p = 2, m = 4 (1F1B, 1F1B with ``recompute=True``, whose
    backward task is one traced call, and interleaved with v = 2), the
    same two-stage cut on one device (one thread runs all 16 tasks: no hand-offs between
    threads, no devices competing) and, with ``others``, every other form on one device."""
    from accel.parallel.forms import make_form

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, 64)).astype(np.float32)
    y = rng.normal(size=(steps * batch, 1)).astype(np.float32)

    def adam():
        return keras.optimizers.Adam(1e-3)

    def fitting(trainer):
        return lambda: trainer.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)

    keras_model = overhead_model()
    keras_model.compile(optimizer=adam(), loss="mse")
    one, two = list(devices_[:1]), list(devices_[:2])
    pipelines = {"pipeline p=1 m=1": (one, 1, "1f1b", 1, False),
                 "pipeline p=2 m=4 1F1B": (two, 4, "1f1b", 1, False),
                 "pipeline p=2 m=4 1F1B, recompute": (two, 4, "1f1b", 1, True),
                 "pipeline p=2 m=4 interleaved v=2": (two, 4, "interleaved", 2, False),
                 "2 stages on 1 device, m=4": (one, 4, "interleaved", 2, False)}
    fns = {"keras fit": fitting(keras_model)}
    for name, (devs, m, schedule, v, again) in pipelines.items():
        fns[name] = fitting(make_form("pipeline", overhead_model(), devs, loss="mse",
                                      optimizer=adam(), num_microbatches=m, schedule=schedule,
                                      num_chunks=v, recompute=again))
    if others:
        for name, (form, options) in _OVERHEAD_FORMS.items():
            # offload's host: the second device (on a GPU machine, a CPU would be the host)
            options = {k: (two[-1] if k == "host" else v) for k, v in options.items()}
            fns[name] = fitting(make_form(form, overhead_model(), one, loss="mse",
                                          optimizer=adam(), **options))
    medians = timing.interleaved_medians(fns, rounds=rounds, repeat=1, warmup=1)
    return {k: v / steps for k, v in medians.items()}


def overhead_report(step_s: dict) -> dict:
    """Ratios to ``fit`` and the per-task overhead: (step at p = 2, m = 4 - ``fit``'s step) /
    16 tasks (2 stages x 4 micro-batches x forward and backward); the interleaved run has 32
    tasks, and the one-device run the same 16 tasks as 1F1B. The recomputing run's figure also
    holds the forward that stage 0's backwards run again (the last stage's runs once, inside
    its backward): compute that ``fit`` does not do, not host cost, so its host cost per task
    is lower still."""
    fit = step_s["keras fit"]
    tasks = {"pipeline p=2 m=4 1F1B": 16, "pipeline p=2 m=4 1F1B, recompute": 16,
             "pipeline p=2 m=4 interleaved v=2": 32, "2 stages on 1 device, m=4": 16}
    return {"ratio": {k: v / fit for k, v in step_s.items()},
            "per_task_s": {k: (step_s[k] - fit) / n for k, n in tasks.items() if k in step_s}}


_FRESH_OVERHEAD = """
import json
import accel.course  # noqa: F401
from accel import devices
from accel.course import pipeline as cp
names = devices.setup(2)
print("RESULT" + json.dumps(cp.measure_overhead(names, **{kwargs!r})))
"""


def bench_overhead(device_names: Sequence[str], quick: bool = False) -> dict:
    """``python -m accel bench pipeline-overhead``: a pipeline's host cost per task against
    Keras's ``fit`` (a fresh process, 2 devices, TensorFlow's default threads), and every
    other form's step on one device against ``fit``; this machine's ceiling beside."""
    kw = dict(steps=2, rounds=1, others=False) if quick else {}
    out = procs.run_python(_FRESH_OVERHEAD.format(kwargs=kw), timeout=600, warm=True)
    step_s = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT"))[6:])
    report = overhead_report(step_s)
    print(timing.format_ratios(step_s, "keras fit"))
    for name, per_task in report["per_task_s"].items():
        again = " (with stage 0's recomputed forward)" if "recompute" in name else ""
        print(f"per-task overhead, {name}: {per_task * 1e3:.2f} ms{again}")
    measured = timing.measure_ceiling()
    print(timing.ceiling_line(measured))
    return {"step_s": step_s, **report, "ceiling": measured.value}


def format_timeline(logs, title: str | None = None) -> str:
    """A timeline from ``pipeline.simulate`` with whole-tick durations as text: one row per
    device, one column per tick, a task of ``k`` ticks written in each of its ``k`` columns
    (``B0 B0``: a backward of two ticks), ``.`` where the device idles; ``title`` on a line
    above. ``ValueError`` if a start or end time is not a whole number of ticks."""
    ends = [e for log in logs for *_, e in log]
    if not ends:
        raise ValueError("logs hold no task")
    cells = [["."] * round(max(ends)) for _ in logs]
    for d, log in enumerate(logs):
        for (_, mb, phase), start, end in log:
            if start != round(start) or end != round(end):
                raise ValueError(f"task {(phase, mb)} runs from {start} to {end}: "
                                 "durations must be whole ticks")
            for t in range(round(start), round(end)):
                cells[d][t] = f"{phase}{mb}"
    width = max(len(c) for row in cells for c in row)
    lines = [] if title is None else [title]
    lines.append("tick    " + " ".join(f"{t:>{width}d}" for t in range(len(cells[0]))))
    lines += [f"stage {d:<2d}" + " ".join(f"{c:>{width}s}" for c in row)
              for d, row in enumerate(cells)]
    return "\n".join(lines)


_TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "zb-h1": "ZB-H1"}


def figure_schedules(num_microbatches: int = 8, num_stages: int = 4,
                     names: Sequence[str] = ("gpipe", "1f1b")):
    """Schedules on the clock, one panel per name (``"gpipe"``, ``"1f1b"``, ``"zb-h1"``: its
    W tasks drawn as ``W3``), one row per stage (pure schedule data, no measurement)."""
    import matplotlib.pyplot as plt

    for name in names:
        checks.one_of("names", name, tuple(_TITLES))
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.1 * len(names)), sharex=True,
                             squeeze=False)
    for ax, key in zip(axes[:, 0], names, strict=True):
        name, schedule = _TITLES[key], pl.make_schedule(key, num_microbatches, num_stages)
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


def _simulated_span(orders, durations) -> float:
    logs = pl.simulate(orders, durations)
    return max(e for log in logs for *_, e in log)


def _forwards_before_backward(order) -> int:
    return next(k for k, task in enumerate(order) if task[2] != "F")


def _smallest_interleaved_m(start: int, num_stages: int, num_chunks: int) -> int:
    m = start
    while True:
        try:
            pl.interleaved_orders(m, num_stages, num_chunks)
            return m
        except ValueError:
            m += 1


def exercise_answers() -> dict[int, float | list[int]]:
    """What the exercises' runs give (p = 4, F = 1): 1, ZB-H1's simulated step over 1F1B's
    (m = 16; 1F1B's B 2; ZB-H1's B 1 and W 2, a W that repeats the input-gradient chain as this
    executor's two-tape split does); 2, the slowest over the fastest of three ways to fit 16
    micro-batches (B = 2) in room for 5: GPipe recomputing (B = 3), 1F1B, four GPipe flushes
    of 4, simulated; 3, the forwards each device runs before its first backward in interleaved
    1F1B (v = 2, m = 8), counted on ``pipeline.interleaved_orders``; 4, the fewest micro-batches,
    at least 6, that interleaved 1F1B with v = 2 accepts."""
    def unit(task):
        return 2.0 if task[2] == "B" else 1.0

    orders = pl.one_f_one_b_orders(16, 4)
    zb = _simulated_span(pl.zb_h1_orders(16, 4), lambda t: 2.0 if t[2] == "W" else 1.0)
    fits = [_simulated_span(pl.gpipe_orders(16, 4), lambda t: 3.0 if t[2] == "B" else 1.0),
            _simulated_span(orders, unit), 4 * _simulated_span(pl.gpipe_orders(4, 4), unit)]
    return {1: zb / _simulated_span(orders, unit), 2: max(fits) / min(fits),
            3: [_forwards_before_backward(o) for o in pl.interleaved_orders(8, 4, 2)],
            4: _smallest_interleaved_m(6, 4, 2)}


def check_exercise(number: int, answer) -> str:
    """The chapter's exercise checks: ``"not answered yet"`` for ``None`` or ``...``, else
    ``"correct"`` or a hint (the answers: ``exercise_answers``; a number within 0.02; for
    exercise 3 a list of four whole numbers, device 0 first)."""
    checks.one_of("number", number, (1, 2, 3, 4))
    if answer is None or answer is Ellipsis:
        return f"exercise {number}: not answered yet"
    want = exercise_answers()[number]
    hints = {1: "the W put off into the drain now takes two ticks: count the work per stage, "
                "then what is left of the bubble",
             2: "each flush takes (m + p - 1)(F + B): count the flushes and what recomputing adds",
             3: "the warm-up forwards are 2(p - d - 1) + (v - 1)p on device d; the steady "
                "state then starts with one more forward before its first backward",
             4: "a device runs chunk 0 for p micro-batches, then chunk 1 for the same p: the "
                "micro-batches go through in groups of p"}
    if number == 3:
        if not (isinstance(answer, list | tuple) and len(answer) == 4
                and all(isinstance(a, int) and not isinstance(a, bool) for a in answer)):
            return f"exercise {number}: give a list of four whole numbers, device 0 first"
        ok = list(answer) == want
    else:
        if isinstance(answer, bool) or not isinstance(answer, int | float):
            return f"exercise {number}: give a number"
        ok = abs(answer - want) <= 0.02
    if ok:
        return f"exercise {number}: correct"
    return f"exercise {number}: not quite ({hints[number]})"
