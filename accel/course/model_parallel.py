"""Chapter 09's experiments: naive model parallelism measured (who idles), the rules of thumb
counted, the RNN wavefront, memory per device, and the ``python -m accel bench
model-parallel`` benchmark.

* ``naive_trace(devices)``: one traced TF1 step of an MLP split over the devices: per-device busy
  intervals and idle fractions (``figure_timeline`` draws them);
* ``count_splits(devices)``: the rules of thumb, counted: the bytes that cross devices per
  training step when a network is split by layers, by neurons, or along its architecture (two
  towers, AlexNet style); each ``*_step`` builds one training step's gradients as a
  ``tf.function`` over two devices, run through ``accel.parallel.trace.transfers_of``;
* ``rnn_forward(devices, mode)``: a stacked RNN, layer ``l`` on device ``l``, unrolled over time;
  ``mode="layer after layer"`` forces layer ``l`` to wait for all of layer ``l-1``;
* ``measure_wavefront()``: those variants timed in a fresh process with two devices and one
  intra-op thread each (a process's thread pools are fixed at start-up);
* ``memory_per_device(model)``: weights, gradients and Adam slots on each device, split vs data
  parallel (chapter 04's estimate over the variables each device holds);
* ``bench``: split step vs one device (4 and 2 devices), wavefront vs layer after layer, idle
  fractions next to (p-1)/p, and the machine's ceiling.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import models, placement, procs, profile, timing, viz
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
           "EXERCISE_COSTS", "dense_by_layers", "dense_by_neurons", "two_tower_cnn",
           "count_splits", "format_splits", "SPLIT_BATCH", "DENSE_WIDTH", "DENSE_LAYERS",
           "CNN_LAYERS", "TOWER_CROSSINGS"]


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
        _, meta = profile.traced_run(sess, g.train_op, feed)
    intervals = trace.busy_intervals(meta, part.devices)
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
        _, meta = profile.traced_run(sess, out, feed)
    iv = trace.busy_intervals(meta, device_names[:2])
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
    out = procs.run_python(_CHILD.format(rounds=rounds, repeat=repeat), timeout=timeout,
                           warm=True)
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
    for n in (2,) if quick else (4, 2):
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
    measured = timing.measure_ceiling()
    out["ceiling"] = measured.value
    lines.append(f"RNN {RNN}, 2 devices x 1 intra-op thread: wavefront "
                 f"{w['wavefront'] * 1e3:.1f} ms, layer after layer "
                 f"{w['layer after layer'] * 1e3:.1f} ms, "
                 f"one device {w['one device'] * 1e3:.1f} ms")
    lines.append(f"wavefront speed-up over layer after layer: {out['wavefront_speedup']:.2f}x "
                 f"(goal >= 1.6x, limit 2x); "
                 f"both devices busy: {w['both busy (wavefront)']:.0%} of a traced wavefront "
                 f"run, {w['both busy (layer after layer)']:.0%} layer after layer")
    lines.append(timing.ceiling_line(measured))
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


SPLIT_BATCH, DENSE_WIDTH, DENSE_LAYERS = 32, 256, 4


def _var(rng, shape, device):
    with tf.device(device):
        return tf.Variable(rng.normal(0, shape[0] ** -0.5, shape).astype(np.float32))


def _gradient_fn(forward, variables, loss_device: str):
    """A tf.function running one SGD step on sum(forward(x)). ``tf.gradients`` puts each
    gradient op on its forward op's device; ``GradientTape.gradient`` would put them all under
    the device scope it is called in (and pull every activation there)."""
    @tf.function
    def step(x):
        with tf.device(loss_device):
            loss = tf.reduce_sum(forward(x))
        grads = tf.gradients(loss, variables)
        for g, v in zip(grads, variables, strict=True):
            with tf.device(v.device):  # an SGD update where the variable lives
                v.assign_sub(1e-3 * g)
    return step


def dense_by_layers(devices: Sequence[str], seed: int = 0):
    """A ReLU MLP of ``DENSE_LAYERS`` square layers; the first half on ``devices[0]``, the rest
    on ``devices[1]``. Returns ``(gradient_fn, input)``."""
    rng = np.random.default_rng(seed)
    half = DENSE_LAYERS // 2
    ws = [_var(rng, (DENSE_WIDTH, DENSE_WIDTH), devices[int(i >= half)])
          for i in range(DENSE_LAYERS)]

    def forward(x):
        for i, w in enumerate(ws):
            with tf.device(devices[int(i >= half)]):
                x = tf.nn.relu(x @ w)
        return x
    return _gradient_fn(forward, ws, devices[1]), tf.ones((SPLIT_BATCH, DENSE_WIDTH))


def dense_by_neurons(devices: Sequence[str], seed: int = 0):
    """The same MLP with every layer's matrix split by columns (output neurons): device ``i``
    computes half of each layer's outputs and needs *all* of the previous layer's outputs."""
    rng = np.random.default_rng(seed)
    w2 = DENSE_WIDTH // 2
    ws = [[_var(rng, (DENSE_WIDTH, w2), d) for d in devices[:2]] for _ in range(DENSE_LAYERS)]

    def forward(x):
        halves = None
        for layer in ws:
            outs = []
            for d, w in zip(devices[:2], layer, strict=True):
                with tf.device(d):  # each device gathers the full input of the layer itself
                    inp = x if halves is None else tf.concat(halves, axis=1)
                    outs.append(tf.nn.relu(inp @ w))
            halves = outs
        with tf.device(devices[0]):
            return tf.concat(halves, axis=1)
    return _gradient_fn(forward, [w for layer in ws for w in layer], devices[0]), \
        tf.ones((SPLIT_BATCH, DENSE_WIDTH))


def _conv(x, w, pool: bool):
    y = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))
    return tf.nn.max_pool2d(y, 2, 2, "VALID") if pool else y


CNN_LAYERS = (  # (kernel, output channels per tower, max-pool after)
    (5, 16, True), (3, 32, True), (3, 32, False), (3, 32, True))
TOWER_CROSSINGS = (2,)  # conv layers that read both towers (conv3, as in AlexNet)


def two_tower_cnn(devices: Sequence[str], cross: Sequence[int] = TOWER_CROSSINGS,
                  seed: int = 0):
    """A small two-column CNN: one tower of channels per device, four conv layers then a fully
    connected one. A conv layer listed in ``cross`` reads both towers' previous outputs (the
    other tower's cross the link); the others read their own tower only. The fully connected
    layer always reads both towers' features. ``cross=TOWER_CROSSINGS`` is AlexNet's 2012
    split; ``cross=(1, 2, 3)`` splits every layer by channels (the 'by neurons' split)."""
    rng = np.random.default_rng(seed)
    d = list(devices[:2])
    kernels, c_in = [], 3
    for i, (k, c, _) in enumerate(CNN_LAYERS):
        fan_in = 2 * c_in if i in cross else c_in
        kernels.append([_var(rng, (k, k, fan_in, c), dv) for dv in d])
        c_in = c
    fc = [_var(rng, (2 * 4 * 4 * c_in, 64), dv) for dv in d]

    def forward(x):
        h = [x, x]
        for i, (_, _, pool) in enumerate(CNN_LAYERS):
            out = []
            for t, dv in enumerate(d):
                with tf.device(dv):  # a crossing layer gathers both towers on each device
                    inp = tf.concat(h, axis=3) if i in cross else h[t]
                    out.append(_conv(inp, kernels[i][t], pool))
            h = out
        feats, outs = [], []
        for t, dv in enumerate(d):
            with tf.device(dv):
                feats.append(tf.reshape(h[t], (SPLIT_BATCH, -1)))
        for t, dv in enumerate(d):
            with tf.device(dv):  # the fully connected layer reads both towers' features
                outs.append(tf.nn.relu(tf.concat(feats, axis=1) @ fc[t]))
        with tf.device(d[0]):
            return tf.concat(outs, axis=1)
    variables = [k for layer in kernels for k in layer] + fc
    return _gradient_fn(forward, variables, d[0]), tf.ones((SPLIT_BATCH, 32, 32, 3))


def count_splits(devices: Sequence[str]) -> dict[str, dict[str, int]]:
    """Bytes crossing devices per step (forward, backward, total) for each split, counted from
    the partition graphs of one run."""
    if len(devices) < 2:
        raise ValueError(f"count_splits needs 2 devices, got {list(devices)}")
    out = {}
    for name, build in (("dense, split by layers", dense_by_layers),
                        ("dense, split by neurons", dense_by_neurons),
                        ("CNN, two towers (AlexNet)", two_tower_cnn),
                        ("CNN, split by channels", lambda d: two_tower_cnn(d, (1, 2, 3)))):
        fn, x = build(devices)
        out[name] = trace.crossing_bytes(trace.transfers_of(fn, x))
    return out


def format_splits(counts: dict[str, dict[str, int]]) -> str:
    """``count_splits``'s result as a table in KiB."""
    width = max(len(k) for k in counts)
    lines = [f"{'split':{width}}  {'forward':>10}  {'backward':>10}  {'total':>10}"]
    for name, c in counts.items():
        lines.append(f"{name:{width}}  " + "  ".join(f"{c[k] / 1024:>6.0f} KiB"
                                                     for k in ("forward", "backward", "total")))
    return "\n".join(lines)
