"""Chapter 07's experiments: naive model parallelism measured (who idles), the RNN wavefront,
memory per device, and the ``python -m accel bench model-parallel`` benchmark.

* ``naive_trace(devices)``: one traced TF1 step of an MLP split over the devices: per-device busy
  intervals and idle fractions (``figure_timeline`` draws them);
* ``rnn_forward(devices, mode)``: a stacked RNN, layer ``l`` on device ``l``, unrolled over time;
  ``mode="layer after layer"`` forces layer ``l`` to wait for all of layer ``l-1``;
* ``measure_wavefront()``: those variants timed in a fresh process with two devices and one
  intra-op thread each (a process's thread pools are fixed at start-up);
* ``memory_per_device(model)``: weights, gradients and Adam slots on each device, split vs data
  parallel (chapter 04's estimate over the variables each device holds);
* ``bench``: split step vs one device (4 and 2 devices), wavefront vs layer after layer, idle
  fractions next to (p-1)/p, and the machine's thread ceiling.
The byte counts of the seed's splits are ``accel.course.model_splits``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import models, placement, procs, timing, viz
from accel.memory.estimate import estimate_training_memory
from accel.parallel import model as mp
from accel.parallel import trace
from accel.parallel.data import make_single_step
from accel.parallel.layers import mlp_layers
from accel.parallel.partition import balance_by_cost, part_costs
from accel.training import squared_error

__all__ = ["TRACE_SIZES", "naive_trace", "figure_timeline", "rnn_forward", "rnn_overlap",
           "wavefront_times", "measure_wavefront", "memory_per_device", "format_memory",
           "split_vs_single", "bench", "check_bytes", "check_balance", "EXERCISE_SIZES",
           "EXERCISE_COSTS"]

TRACE_SIZES = (256, 512, 512, 512, 512, 512, 512, 512, 64)  # 8 layers
RNN = {"hidden": 256, "batch": 64, "steps": 24}


def naive_trace(device_names: Sequence[str], sizes: Sequence[int] = TRACE_SIZES, batch: int = 256,
                warmup: int = 3) -> dict:
    """One FULL_TRACE step of the MLP ``sizes`` split by count over ``device_names`` (TF1 form):
    ``{"intervals": {device: [(start, end), ...]}, "idle": {device: fraction}, "span": s}``."""
    part = mp.split(mlp_layers(sizes), device_names, [sizes[0]])
    g = mp.build_graph(part, squared_error, 0.01, [batch, sizes[0]], [batch, sizes[-1]])
    rng = np.random.default_rng(0)
    feed = {g.x: rng.normal(size=(batch, sizes[0])).astype(np.float32),
            g.y: rng.normal(size=(batch, sizes[-1])).astype(np.float32)}
    with tf.compat.v1.Session(graph=g.graph, config=placement.session_config()) as sess:
        sess.run(g.init_op)
        for _ in range(warmup):
            sess.run(g.train_op, feed)
        _, meta = trace.traced_run(sess, g.train_op, feed)
    intervals = trace.busy_intervals(meta.step_stats, part.devices)
    span = max(b for v in intervals.values() for _, b in v)
    return {"intervals": intervals, "idle": trace.idle_fractions(intervals), "span": span}


def figure_timeline(result: dict | None = None, min_gap: float = 0.01):
    """The busy intervals of ``naive_trace`` as a Gantt chart, one lane per device (gaps
    shorter than ``min_gap`` of the step are closed so the bars stay readable)."""
    res = result if result is not None else naive_trace(
        [d.name for d in tf.config.list_logical_devices()][:4])
    rows = []
    for dev, spans in res["intervals"].items():
        merged: list[list[float]] = []
        for a, b in spans:
            if merged and a - merged[-1][1] < min_gap * res["span"]:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        short = dev.replace("/device:", "")
        rows += [(f"{short} ({res['idle'][dev]:.0%} idle)", a * 1e3, b * 1e3, short)
                 for a, b in merged]
    fig = viz.timeline(rows, title="one training step, naive model parallelism", xlabel="ms")
    for text in list(fig.axes[0].texts):
        text.remove()
    return fig


def rnn_forward(device_names: Sequence[str], mode: str = "wavefront", layers: int = 2,
                seed: int = 0):
    """A ``tf.function`` running a stacked tanh RNN (plain ops) over a sequence
    ``[steps, batch, hidden]``; layer ``l`` on ``device_names[l]``. ``mode="layer after
    layer"`` adds control dependencies so layer ``l`` starts after all of layer ``l-1``."""
    if mode not in ("wavefront", "layer after layer"):
        raise ValueError(f"mode must be 'wavefront' or 'layer after layer', got {mode!r}")
    if len(device_names) != layers:
        raise ValueError(f"give one device per layer: {layers} layers, {list(device_names)}")
    h_dim = RNN["hidden"]
    rng = np.random.default_rng(seed)
    weights = []
    for dev in device_names:
        with tf.device(dev):
            weights.append([tf.Variable(rng.normal(0, h_dim ** -0.5, (h_dim, h_dim))
                                        .astype(np.float32)) for _ in range(2)])

    return tf.function(lambda xs: _rnn_body(device_names, weights, xs, mode))


def _rnn_body(device_names, weights, xs, mode: str):
    inputs = tf.unstack(xs)
    for dev, (w, u) in zip(device_names, weights, strict=True):
        with tf.device(dev):
            if mode == "layer after layer":
                with tf.control_dependencies(inputs):  # all of the previous layer first
                    inputs = [tf.identity(i) for i in inputs]
            h, outs = tf.zeros_like(inputs[0]), []
            for x in inputs:
                h = tf.tanh(x @ w + h @ u)
                outs.append(h)
        inputs = outs
    return tf.stack(inputs)


def _both_busy(a: list, b: list) -> float:
    """Seconds during which two merged interval lists overlap."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def rnn_overlap(device_names: Sequence[str], mode: str, warmup: int = 2) -> float:
    """The share of one traced TF1 run of the RNN during which both devices were busy at once
    (from ``FULL_TRACE`` step stats, so it holds even when the machine's cores are shared)."""
    h_dim = RNN["hidden"]
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        weights = []
        for dev in device_names[:2]:
            with tf.device(dev):
                weights.append([tf.constant(rng.normal(0, h_dim ** -0.5, (h_dim, h_dim))
                                             .astype(np.float32)) for _ in range(2)])
        xs = tf.compat.v1.placeholder(tf.float32, (RNN["steps"], RNN["batch"], h_dim))
        out = _rnn_body(device_names[:2], weights, xs, mode)
    feed = {xs: rng.normal(size=xs.shape.as_list()).astype(np.float32)}
    with tf.compat.v1.Session(graph=g, config=placement.session_config()) as sess:
        for _ in range(warmup):
            sess.run(out, feed)
        _, meta = trace.traced_run(sess, out, feed)
    iv = trace.busy_intervals(meta.step_stats, device_names[:2])
    span = max(b for v in iv.values() for _, b in v) - min(a for v in iv.values() for a, _ in v)
    return _both_busy(*iv.values()) / span


def wavefront_times(device_names: Sequence[str], rounds: int = 5, repeat: int = 3) -> dict:
    """Median seconds of the RNN's forward pass: wavefront and layer after layer on two devices,
    and both layers on one device; whether all three give the same outputs; and the share of a
    traced run during which both devices were busy, for both modes (``rnn_overlap``)."""
    xs = tf.constant(np.random.default_rng(1).normal(
        size=(RNN["steps"], RNN["batch"], RNN["hidden"])).astype(np.float32))
    fns = {"one device": rnn_forward([device_names[0]] * 2),
           "layer after layer": rnn_forward(device_names[:2], "layer after layer"),
           "wavefront": rnn_forward(device_names[:2])}
    outs = {k: f(xs).numpy() for k, f in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            samples[k].append(timing.time_fn(lambda f=f: f(xs).numpy(), repeat=repeat, warmup=0))
    same = all(np.allclose(o, outs["one device"], rtol=1e-5, atol=1e-6) for o in outs.values())
    overlap = {f"both busy ({m})": rnn_overlap(device_names, m)
               for m in ("wavefront", "layer after layer")}
    return {**{k: float(np.median(v)) for k, v in samples.items()}, "same outputs": same,
            **overlap}


_CHILD = """
import json
from accel import devices
names = devices.setup(2, intra_op_threads=1)
from accel.course.model_parallel import wavefront_times
print("ACCEL_RESULT" + json.dumps(wavefront_times(names, {rounds}, {repeat})))
"""


def measure_wavefront(rounds: int = 5, repeat: int = 3, timeout: float = 180) -> dict:
    """``wavefront_times`` in a fresh process with 2 devices and ONE intra-op thread (so each
    matmul uses one core and two devices can really run at once on two cores)."""
    out = procs.run_python(_CHILD.format(rounds=rounds, repeat=repeat), timeout=timeout)
    line = next((ln for ln in out.splitlines() if ln.startswith("ACCEL_RESULT")), None)
    if line is None:
        raise procs.ChildFailed(f"the child printed no result:\n{out[-2000:]}")
    return json.loads(line[len("ACCEL_RESULT"):])


def memory_per_device(model: mp.SplitModel, optimizer: str = "adam") -> dict[str, dict]:
    """Bytes of weights, gradients and optimizer slots each device holds: under the split (the
    variables that live there) and under data parallelism (every device holds all of them)."""
    by_device: dict[str, list] = {}
    for v in model.variables():
        by_device.setdefault(placement.short_device(v.device), []).append(v)
    every = estimate_training_memory(model.variables(), optimizer)
    out = {}
    for dev in model.partition.devices:
        est = estimate_training_memory(by_device.get(dev, []), optimizer)
        out[dev] = {"split": est, "data parallel": every}
    return out


def format_memory(mem: dict[str, dict]) -> str:
    """``memory_per_device`` as a table in KiB (weights + gradients + slots)."""
    lines = [f"{'device':14}  {'split: w / g / slots':>24}  {'data parallel: w / g / slots':>30}"]
    for dev, m in mem.items():
        cells = []
        for key in ("split", "data parallel"):
            e = m[key]
            cells.append(f"{e.weights / 1024:.0f} / {e.gradients / 1024:.0f} / "
                         f"{e.optimizer_slots / 1024:.0f} KiB")
        lines.append(f"{dev:14}  {cells[0]:>24}  {cells[1]:>30}")
    return "\n".join(lines)


def split_vs_single(device_names: Sequence[str], n: int, sizes: Sequence[int] = TRACE_SIZES,
                    batch: int = 256, rounds: int = 3, repeat: int = 5) -> dict:
    """Median step time of the MLP split over ``n`` devices vs the one-device step."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, sizes[0])).astype(np.float32))
    y = tf.constant(rng.normal(size=(batch, sizes[-1])).astype(np.float32))
    split = mp.make_split_step(mp.split(mlp_layers(sizes), device_names[:n], [sizes[0]]),
                               squared_error, 0.01)
    single = make_single_step(models.mlp_apply, squared_error, models.mlp_init(list(sizes)),
                              0.01, device_names[0])
    steps = {"single": lambda: single(x, y).numpy(), "split": lambda: split(x, y).numpy()}
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():
        fn()
    for _ in range(rounds):
        for k, fn in steps.items():
            samples[k].append(timing.time_fn(fn, repeat=repeat, warmup=0))
    return {k: float(np.median(v)) for k, v in samples.items()}


def bench(device_names: Sequence[str], quick: bool = False) -> dict:
    """The ``model-parallel`` benchmark: ratios measured in this run (see the module doc)."""
    rounds, repeat = (1, 1) if quick else (3, 5)
    out: dict[str, float] = {}
    lines = [f"MLP {list(TRACE_SIZES)}, batch 256; median step time"]
    for n in (4, 2):
        t = split_vs_single(device_names, n, rounds=rounds, repeat=repeat)
        out[f"split/single_{n}"] = t["split"] / t["single"]
        lines.append(f"split over {n} devices: {t['split'] * 1e3:7.1f} ms, one device "
                     f"{t['single'] * 1e3:7.1f} ms -> split/single {out[f'split/single_{n}']:.2f}")
    res = naive_trace(device_names[:4])
    p = len(res["idle"])
    out["expected_idle"] = (p - 1) / p
    lines.append("idle fraction per device (one traced TF1 step): " + ", ".join(
        f"{d.replace('/device:', '')} {f:.2f}" for d, f in res["idle"].items())
                 + f"   expected (p-1)/p = {out['expected_idle']:.2f}")
    out.update({f"idle_{d}": f for d, f in res["idle"].items()})
    w = measure_wavefront(rounds=2 if quick else 5, repeat=1 if quick else 3)
    out["wavefront_speedup"] = w["layer after layer"] / w["wavefront"]
    out["one_device/wavefront"] = w["one device"] / w["wavefront"]
    out["ceiling"] = timing.ceiling()
    lines.append(f"RNN {RNN}, 2 devices x 1 intra-op thread: wavefront "
                 f"{w['wavefront'] * 1e3:.1f} ms, layer after layer "
                 f"{w['layer after layer'] * 1e3:.1f} ms, "
                 f"one device {w['one device'] * 1e3:.1f} ms")
    lines.append(f"wavefront speed-up over layer after layer: {out['wavefront_speedup']:.2f}x "
                 f"(goal >= 1.6x, limit 2x); "
                 f"both devices busy: {w['both busy (wavefront)']:.0%} of a traced wavefront "
                 f"run, {w['both busy (layer after layer)']:.0%} layer after layer")
    lines.append(timing.ceiling_line(out["ceiling"]))
    out.update({k: w[k] for k in ("both busy (wavefront)", "both busy (layer after layer)")})
    print("\n".join(lines))
    return out


EXERCISE_SIZES = (16, 1024, 1024, 4)
EXERCISE_COSTS = (5.0, 1.0, 1.0, 1.0, 1.0, 1.0)


def check_bytes(answer, device_names: Sequence[str]) -> str:
    """Exercise 1: bytes of activations and activation gradients crossing devices in one
    training step of ``mlp_layers(EXERCISE_SIZES)`` split over 3 devices, batch 64 (labels and
    loss not counted), checked against the placed graph."""
    if answer is None:
        return "not yet: set answer to a number of bytes"
    part = mp.split(mlp_layers(EXERCISE_SIZES), device_names[:3], [EXERCISE_SIZES[0]])
    step = mp.make_split_step(part, squared_error, 0.01)
    x = tf.zeros((64, EXERCISE_SIZES[0]))
    y = tf.zeros((64, EXERCISE_SIZES[-1]))
    counted = sum(t.nbytes for t in trace.transfers_of(step, x, y)  # activations, not labels
                  if not t.control and t.shape == (64, EXERCISE_SIZES[1]))
    return "right" if answer == counted else "not quite: count the boundaries, then both ways"


def check_balance(answer) -> str:
    """Exercise 2: the split of ``EXERCISE_COSTS`` (seconds per layer) over 2 devices whose
    slowest part is fastest."""
    if answer is None:
        return "not yet: set answer to a list of two part sizes"
    best = max(part_costs(EXERCISE_COSTS, balance_by_cost(EXERCISE_COSTS, 2)))
    try:
        mine = max(part_costs(EXERCISE_COSTS, answer))
    except ValueError as exc:
        return f"not quite: {exc}"
    return "right" if mine == best else f"not quite: your slowest part takes {mine:g} s"
