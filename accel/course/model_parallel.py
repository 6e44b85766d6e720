"""Chapter 09's experiments: naive model parallelism measured (who idles), the rules of thumb
counted, the RNN wavefront, memory per device, and the ``python -m accel bench
model-parallel`` benchmark.

* ``naive_trace(devices)``: one traced TF1 step of an MLP split over the devices: per-device busy
  intervals and idle fractions (``figure_timeline`` draws them);
* ``count_splits(devices)``: the rules of thumb, counted and traced: for a dense network split
  by layers or by neurons and a small CNN split by layers, into two towers (Krizhevsky,
  Sutskever & Hinton 2012) or by channels at every layer, the bytes that cross devices in one
  SGD step (``split_bytes``, from the partition graphs) and the share of a traced step during
  which both devices worked (``split_overlap``);
* ``rnn_forward(devices, mode)``: a stacked RNN, layer ``l`` on device ``l``; ``mode="layer
  after layer"`` makes layer ``l`` wait for all of layer ``l-1``; ``wavefront_limit(T, L)`` the
  cell count ``T L / (T + L - 1)``; ``measure_wavefront()`` the variants timed alike in a fresh
  process with one intra-op thread, with the traced overlap, the count and the ceiling;
* (today's GPUs' memory, a 7B-class transformer's memory per GPU and naive model
  parallelism's step on H100s are cost models: ``accel.costmodel.model_parallel``);
* ``memory_per_device(model)``: weights, gradients and Adam slots on each device, split vs data
  parallel (chapter 04's estimate over the variables each device holds);
* ``bench``: split step vs one device (4 and 2 devices), idle fractions next to (p-1)/p, the
  wavefront against one device and the cell count, and the ceiling;
* ``hybrid_traffic(transfers, replicas)``: a hybrid split step's transfers by kind (boundary
  activations, weights read and gradients sent back between replicas, batch, losses);
* the exercises' checks: ``check_cut``, ``check_embedding_split``, ``check_skip_cut``,
  ``check_stage_memory``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import checks, models, placement, procs, profile, timing, viz
from accel.memory.estimate import estimate_training_memory
from accel.parallel import model as mp
from accel.parallel import pipeline, trace
from accel.parallel.data import make_single_step
from accel.parallel.layers import mlp_layers
from accel.parallel.partition import balance_by_cost, part_costs
from accel.training import squared_error

__all__ = ["TRACE_SIZES", "RNN", "naive_trace", "figure_timeline", "WAVEFRONT_MODES",
           "WAVEFRONT_ROWS", "wavefront_limit", "wavefront_grid", "rnn_forward", "overlap_of",
           "rnn_overlap", "wavefront_times", "measure_wavefront", "format_wavefront",
           "max_relative_difference", "memory_per_device", "format_memory", "split_vs_single",
           "bench", "CUT_SIZES", "CUT_BATCH", "cut_table",
           "check_cut", "EMBEDDING_EXERCISE", "embedding_costs", "check_embedding_split",
           "skip_model", "check_skip_cut", "STAGE_EXERCISE", "check_stage_memory", "SPLIT_BATCH",
           "DENSE_WIDTH", "DENSE_LAYERS", "CNN_LAYERS", "TOWER_CROSSINGS", "CNN_INPUT",
           "dense_by_layers", "dense_by_neurons", "two_tower_cnn", "cnn_by_layers", "SPLITS",
           "split_bytes", "split_overlap", "count_splits", "format_splits"]


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


WAVEFRONT_MODES = ("wavefront", "layer after layer")


def wavefront_limit(steps: int, layers: int = 2) -> float:
    """What a wavefront gains over running the same cells one after another when every cell
    costs the same in both runs (``layers`` layers of ``steps`` steps, one layer per device,
    free transfers): ``T L`` cell times against ``T + L - 1`` waves, ``T L / (T + L - 1)``. A
    count, not a bound: a run whose cells cost more alone than beside another lands above it."""
    checks.positive_int("steps", steps)
    checks.positive_int("layers", layers)
    return steps * layers / (steps + layers - 1)


def wavefront_grid(steps: int, layers: int = 2) -> str:
    """The wavefront as a table: a row per layer (device), a column per wave, ``tK``: step K."""
    checks.positive_int("steps", steps)
    checks.positive_int("layers", layers)
    rows = []
    for layer in range(layers):
        row = ["  ."] * (steps + layers - 1)
        for t in range(steps):
            row[t + layer] = f"t{t:<2}"
        rows.append(f"layer {layer} (device {layer}): " + " ".join(row))
    return "\n".join(rows)


def rnn_forward(device_names: Sequence[str], mode: str = "wavefront", layers: int = 2,
                seed: int = 0):
    """A ``tf.function`` running a stacked tanh RNN (plain ops) over a sequence
    ``[steps, batch, hidden]``; layer ``l`` on ``device_names[l]`` (a name twice: one device).
    Each cell is one matmul, ``h_t = tanh([x_t, h_{t-1}] @ W)``: a layer's cells run in order.
    ``mode="layer after layer"``: layer ``l``'s first cell waits for layer ``l-1``'s last output
    (control edges on that cell's ops only): through the chain of ``h``, the whole layer waits."""
    checks.one_of("mode", mode, WAVEFRONT_MODES)
    if len(device_names) != layers:
        raise ValueError(f"give one device per layer: {layers} layers, {list(device_names)}")
    h_dim = RNN["hidden"]
    rng = np.random.default_rng(seed)
    weights = []
    for dev in device_names:
        with tf.device(dev):
            weights.append(tf.Variable(rng.normal(0, (2 * h_dim) ** -0.5, (2 * h_dim, h_dim))
                                       .astype(np.float32)))

    return tf.function(lambda xs: _rnn_body(device_names, weights, xs, mode), autograph=False)


def _rnn_body(device_names, weights, xs, mode: str):
    inputs = tf.unstack(xs)
    for layer, (dev, w) in enumerate(zip(device_names, weights, strict=True)):
        # layer after layer: the first cell waits for the previous layer's last output, and
        # every later cell waits for the cell before it (the ops are the wavefront's)
        wait = [inputs[-1]] if mode == "layer after layer" and layer > 0 else []
        with tf.device(dev):
            outs = []
            with tf.control_dependencies(wait):
                h = tf.tanh(tf.concat([inputs[0], tf.zeros_like(inputs[0])], axis=1) @ w)
            outs.append(h)
            for x in inputs[1:]:
                h = tf.tanh(tf.concat([x, h], axis=1) @ w)
                outs.append(h)
        inputs = outs
    return tf.stack(inputs)


def _both_in_flight(a: list, b: list) -> float:
    """Seconds during which two merged interval lists overlap."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def overlap_of(intervals: dict[str, list]) -> dict[str, float]:
    """From two devices' busy intervals (``trace.busy_intervals``): the share of the span
    during which each device had an op in flight, and the op time summed over both devices /
    the span. Logical CPU devices share the process's thread pools and the machine's cores, so
    this says which ops the dataflow let run at the same time, not that each had a core."""
    lanes = list(intervals.values())
    if len(lanes) != 2:
        raise ValueError(f"overlap_of needs 2 devices' intervals, got {len(lanes)}")
    span = max(b for v in lanes for _, b in v) - min(a for v in lanes for a, _ in v)
    busy = sum(b - a for v in lanes for a, b in v)
    return {"both in flight": _both_in_flight(*lanes) / span, "busy / span": busy / span}


def rnn_overlap(device_names: Sequence[str], mode: str, warmup: int = 2, runs: int = 3
                ) -> dict[str, float]:
    """``overlap_of`` traced TF1 runs of the RNN's forward pass, layer ``l`` on device ``l``
    (``FULL_TRACE`` step stats), the median of ``runs`` runs for each figure."""
    h_dim = RNN["hidden"]
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        weights = []
        for dev in device_names[:2]:
            with tf.device(dev):
                weights.append(tf.constant(rng.normal(0, (2 * h_dim) ** -0.5, (2 * h_dim, h_dim))
                                           .astype(np.float32)))
        xs = tf.compat.v1.placeholder(tf.float32, (RNN["steps"], RNN["batch"], h_dim))
        out = _rnn_body(device_names[:2], weights, xs, mode)
    feed = {xs: rng.normal(size=xs.shape.as_list()).astype(np.float32)}
    with tf.compat.v1.Session(graph=g, config=placement.session_config()) as sess:
        for _ in range(warmup):
            sess.run(out, feed)
        found = [overlap_of(trace.busy_intervals(profile.traced_run(sess, out, feed)[1],
                                                 device_names[:2])) for _ in range(runs)]
    return {k: float(np.median([f[k] for f in found])) for k in found[0]}


WAVEFRONT_ROWS = {  # name -> (devices of layers 0 and 1 as indices, mode)
    "split, wavefront": ((0, 1), "wavefront"),
    "split, layer after layer": ((0, 1), "layer after layer"),
    "one device, free dataflow": ((0, 0), "wavefront"),
    "one device, layer after layer": ((0, 0), "layer after layer"),
}


def wavefront_times(device_names: Sequence[str], rounds: int = 5, repeat: int = 3,
                    trace_runs: int = 3) -> dict:
    """Median seconds of the RNN's forward pass for each of ``WAVEFRONT_ROWS`` (the same ops,
    the same warm-up, timed in interleaved rounds), whether all give the same outputs, and
    ``rnn_overlap`` of the split in both modes (``"traced <mode>"``)."""
    xs = tf.constant(np.random.default_rng(1).normal(
        size=(RNN["steps"], RNN["batch"], RNN["hidden"])).astype(np.float32))
    fns = {k: rnn_forward([device_names[i] for i in devs], mode)
           for k, (devs, mode) in WAVEFRONT_ROWS.items()}
    outs = {k: f(xs).numpy() for k, f in fns.items()}  # trace each once, untimed
    times = timing.interleaved_medians({k: (lambda f=f: f(xs).numpy()) for k, f in fns.items()},
                                       rounds=rounds, repeat=repeat, warmup=1)
    ref = outs["one device, layer after layer"]
    same = all(np.allclose(o, ref, rtol=1e-5, atol=1e-6) for o in outs.values())
    traced = {f"traced {m}": rnn_overlap(device_names, m, warmup=min(2, trace_runs),
                                         runs=trace_runs) for m in WAVEFRONT_MODES}
    return {**times, "same outputs": same, **traced}


_CHILD = """
import json
from accel import devices
names = devices.setup(2, intra_op_threads=1)
from accel.course.model_parallel import wavefront_times
from accel import timing
before = timing.measure_ceiling()
out = wavefront_times(names, {rounds}, {repeat})
after = timing.measure_ceiling()
best = max(before, after, key=lambda c: c.value)
out["ceiling"], out["others"] = best.value, best.others
print("ACCEL_RESULT" + json.dumps(out))
"""


def measure_wavefront(rounds: int = 5, repeat: int = 3, timeout: float = 180) -> dict:
    """``wavefront_times`` in a fresh process with 2 devices and ONE intra-op thread: all CPU
    devices of a process share one intra-op pool, so with one thread a matmul runs on the
    thread that runs it, and two ops run at once only when the executor dispatches them on two
    inter-op threads. Adds the ceiling measured in that process (the higher of before and
    after the timings, with the other processes' load then) and the cell count
    (``wavefront_limit``)."""
    out = procs.run_python(_CHILD.format(rounds=rounds, repeat=repeat), timeout=timeout,
                           warm=True)
    line = next((ln for ln in out.splitlines() if ln.startswith("ACCEL_RESULT")), None)
    if line is None:
        raise procs.ChildFailed(f"the child printed no result:\n{out[-2000:]}")
    res = json.loads(line[len("ACCEL_RESULT"):])
    res["limit"] = wavefront_limit(RNN["steps"])
    return res


def format_wavefront(w: dict) -> str:
    """``measure_wavefront``'s result, every time from one process and one clock: the four
    times, each against one device running the layers one after another (what a GPU's single
    in-order stream does), the split against one device with free dataflow, the cell count, the
    share of the traced runs in which both devices had an op in flight, and that process's
    ceiling."""
    base = w["one device, layer after layer"]
    lines = [f"{k:31} {w[k] * 1e3:7.1f} ms   {base / w[k]:.2f}x vs one device layer after layer"
             for k in WAVEFRONT_ROWS]
    lines.append(f"split wavefront vs one device with free dataflow: "
                 f"{w['one device, free dataflow'] / w['split, wavefront']:.2f}x")
    lines.append(f"cell count T L / (T + L - 1), T = {RNN['steps']}, L = 2: "
                 f"{w['limit']:.2f}x")
    for m in WAVEFRONT_MODES:
        t = w[f"traced {m}"]
        lines.append(f"traced split, {m:17}: both devices with an op in flight "
                     f"{t['both in flight']:.0%} of the run")
    lines.append(f"same outputs in all four: {w['same outputs']}")
    lines.append(timing.ceiling_line(timing.Ceiling(w["ceiling"], w.get("others"))))
    return "\n".join(lines)


def max_relative_difference(actual: Sequence, reference: Sequence) -> float:
    """The largest ``|actual - reference|`` over all arrays, over the largest ``|reference|``
    (e.g. two models' ``get_weights()``)."""
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in actual])
    r = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in reference])
    if a.shape != r.shape:
        raise ValueError(f"{a.size} values against {r.size}: not the same arrays")
    return float(np.abs(a - r).max() / max(np.abs(r).max(), 1e-300))


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
    return timing.interleaved_medians(steps, rounds=rounds, repeat=repeat, warmup=1)


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
    w = measure_wavefront(rounds=2 if quick else 7, repeat=1 if quick else 5)
    wave = w["split, wavefront"]
    out["wavefront/layer_after_layer"] = w["split, layer after layer"] / wave
    out["wavefront/one_device_layer_after_layer"] = w["one device, layer after layer"] / wave
    out["wavefront/one_device"] = w["one device, free dataflow"] / wave
    out["wavefront_limit"], out["ceiling"] = w["limit"], w["ceiling"]
    out.update({f"both in flight ({m})": w[f"traced {m}"]["both in flight"]
                for m in WAVEFRONT_MODES})
    lines.append(f"RNN {RNN}, 2 devices x 1 intra-op thread:")
    lines.append(format_wavefront(w))
    print("\n".join(lines))
    return out


CUT_SIZES = (16, 1024, 64, 1024, 1024, 4)  # exercise 1's MLP: a narrow layer, then a wide one
CUT_BATCH = 64


def cut_table(device_names: Sequence[str], sizes: Sequence[int] = CUT_SIZES,
              batch: int = CUT_BATCH) -> list[dict]:
    """Every cut of ``mlp_layers(sizes)`` over two devices: ``first`` (layers on device 0),
    ``crossing`` (activation and gradient bytes per step, from the placed graph: labels and loss
    left out) and each part's ``param_bytes``."""
    if len(device_names) < 2:
        raise ValueError(f"cut_table needs 2 devices, got {list(device_names)}")
    batch = checks.positive_int("batch", batch)
    layers = mlp_layers(list(sizes))
    rows = []
    for first in range(1, len(layers)):
        part = mp.split(layers, device_names[:2], [sizes[0]],
                        balance=[first, len(layers) - first])
        step = mp.make_split_step(part, squared_error, 0.01)
        moved = [t for t in trace.transfers_of(step, tf.zeros((batch, sizes[0])),
                                               tf.zeros((batch, sizes[-1])))
                 if not t.control and t.shape == (batch, sizes[first])]
        rows.append({"first": first, "crossing": sum(t.nbytes for t in moved),
                     "param_bytes": [p.param_bytes for p in part.parts]})
    return rows


def check_cut(answer, device_names: Sequence[str]) -> str:
    """Exercise 1: ``(layers on device 0 of the cut crossing the fewest bytes, whether
    balance="bytes" picks it)``, checked against ``cut_table`` and ``mp.split``."""
    if answer is None:
        return "exercise 1: not answered yet (set answer1 to (layers, True or False))"
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return f"exercise 1: not quite: give a pair like (3, True), got {answer!r}"
    first, same, rows = answer[0], answer[1], cut_table(device_names)
    best = min(rows, key=lambda r: r["crossing"])
    by_bytes = mp.split(mlp_layers(list(CUT_SIZES)), device_names[:2], [CUT_SIZES[0]],
                        balance="bytes").balance[0]
    table = "; ".join(f"{r['first']} | {len(rows) + 1 - r['first']}: {r['crossing']} B crossing, "
                      f"parts {r['param_bytes'][0]:,} / {r['param_bytes'][1]:,} param bytes"
                      for r in rows)
    if first != best["first"]:
        return "exercise 1: not quite: which activation between two layers is the smallest?"
    if bool(same) != (by_bytes == best["first"]):
        return "exercise 1: not quite: the cut is right; now add up each part's parameter bytes"
    return f"exercise 1: correct: cuts (layers per device): {table}"


EMBEDDING_EXERCISE = {"vocab": 131072, "hidden": 4096, "blocks": 32, "stages": 4}


def embedding_costs(vocab: int, hidden: int, blocks: int) -> tuple[list[float], list[float]]:
    """(compute, parameters) per layer of ``[embedding, block x blocks, output projection]``,
    in units of one block. Compute: forward matmul FLOPs per token, ``24 h^2`` a block
    (attention scores left out), ``2 h V`` the output projection, 0 the embedding (a lookup).
    Parameters: ``12 h^2`` a block, ``V h`` the embedding and the projection each (untied)."""
    v, h = checks.positive_int("vocab", vocab), checks.positive_int("hidden", hidden)
    n = checks.positive_int("blocks", blocks)
    head, table = 2 * h * v / (24 * h * h), v * h / (12 * h * h)
    return [0.0, *[1.0] * n, head], [table, *[1.0] * n, table]


def check_embedding_split(answer) -> str:
    """Exercise 2: transformer blocks per stage (a list of ``stages`` counts adding up to
    ``blocks``; stage 0 also runs the embedding, the last the output projection) whose slowest
    stage (compute) is fastest, checked against ``balance_by_cost`` on ``embedding_costs``."""
    if answer is None:
        return "exercise 2: not answered yet (set answer2 to a list of 4 block counts)"
    e = EMBEDDING_EXERCISE
    compute, params = embedding_costs(e["vocab"], e["hidden"], e["blocks"])
    try:
        counts = [int(k) for k in answer]
    except (TypeError, ValueError):
        return f"exercise 2: not quite: give {e['stages']} block counts, got {answer!r}"
    if (len(counts) != e["stages"] or sum(counts) != e["blocks"] or min(counts) < 0
            or min(counts[1:-1], default=1) < 1):
        return (f"exercise 2: not quite: give {e['stages']} block counts adding up to "
                f"{e['blocks']}, got {answer!r}")
    balance = [counts[0] + 1, *counts[1:-1], counts[-1] + 1]  # embedding, projection included
    best = max(part_costs(compute, balance_by_cost(compute, e["stages"])))
    mine = part_costs(compute, balance)
    by_count = max(part_costs(compute, [e["blocks"] // e["stages"] + 1, *[e["blocks"] //
                                        e["stages"]] * (e["stages"] - 2),
                                        e["blocks"] // e["stages"] + 1]))
    held = " / ".join(f"{x:.1f}" for x in part_costs(params, balance))
    if max(mine) <= best + 1e-9:
        return (f"exercise 2: correct: slowest stage {max(mine):.2f} block-times (equal counts: "
                f"{by_count:.2f}); parameters per stage in blocks: {held}")
    return f"exercise 2: not quite: your slowest stage takes {max(mine):.2f} block-times"


def skip_model():
    """Exercise 3's functional Keras model (float32): ``a`` (512) -> ``b`` (64) -> ``c`` (512),
    then ``add = a + c`` (a skip connection over ``b`` and ``c``) -> ``out`` (10)."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((32,), name="x")
    a = keras.layers.Dense(512, activation="relu", name="a")(x)
    b = keras.layers.Dense(64, activation="relu", name="b")(a)
    c = keras.layers.Dense(512, name="c")(b)
    added = keras.layers.Add(name="add")([a, c])
    return keras.Model(x, keras.layers.Dense(10, name="out")(added))


def check_skip_cut(answer, device_names: Sequence[str]) -> str:
    """Exercise 3: bytes per example crossing the cut of ``skip_model()`` split over two
    devices with part 2 beginning at layer ``c`` (``ModelParallel(..., split_points=["c"])``),
    read from ``ModelParallel.crossings()``."""
    if answer is None:
        return "exercise 3: not answered yet (set answer3 to bytes per example)"
    import keras

    split = mp.ModelParallel(skip_model(), device_names[:2], loss=keras.losses.MeanSquaredError(),
                             optimizer=keras.optimizers.SGD(0.01), split_points=["c"])
    rows = split.crossings()[0]
    counted = sum(r[3] for r in rows)
    table = "; ".join(f"{name} {list(shape)} {dtype}: {size} B" for name, shape, dtype, size
                      in rows)
    if answer == counted:
        return f"exercise 3: correct: {table}"
    return "exercise 3: not quite: list every tensor a layer after the cut reads from before it"


STAGE_EXERCISE = {"stages": 4, "microbatches": 8}


def check_stage_memory(answer) -> str:
    """Exercise 4: how many times more micro-batches' activations stage 0 holds at its peak
    than the last stage under 1F1B, counted on the schedule (``pipeline.peak_in_flight``)."""
    if answer is None:
        return "exercise 4: not answered yet (set answer4 to a ratio)"
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"exercise 4: not quite: give a number, got {answer!r}"
    p, m = STAGE_EXERCISE["stages"], STAGE_EXERCISE["microbatches"]
    peaks = pipeline.peak_in_flight(pipeline.one_f_one_b_schedule(m, p), p)
    if abs(answer - peaks[0] / peaks[-1]) <= 1e-9:
        return (f"exercise 4: correct: micro-batches held at the peak, stage 0 to {p - 1}: "
                f"{peaks}")
    return "exercise 4: not quite: count the forwards each stage runs before its first backward"


SPLIT_BATCH, DENSE_WIDTH, DENSE_LAYERS = 32, 1024, 4
CNN_LAYERS = (  # (kernel, output channels per tower, max-pool after)
    (5, 16, True), (3, 32, True), (3, 32, False), (3, 32, True))
TOWER_CROSSINGS = (2,)  # conv layers that read both towers (conv3, as in AlexNet)
CNN_INPUT = (32, 32, 3)


def _var(rng, shape, device):
    with tf.device(device):
        return tf.Variable(rng.normal(0, shape[0] ** -0.5, shape).astype(np.float32))


def dense_by_layers(devices: Sequence[str], rng):
    """A ReLU MLP of ``DENSE_LAYERS`` square layers; the first half on ``devices[0]``, the rest
    on ``devices[1]``. Returns ``(forward, variables, input shape)``."""
    half = DENSE_LAYERS // 2
    ws = [_var(rng, (DENSE_WIDTH, DENSE_WIDTH), devices[int(i >= half)])
          for i in range(DENSE_LAYERS)]

    def forward(x):
        for i, w in enumerate(ws):
            with tf.device(devices[int(i >= half)]):
                x = tf.nn.relu(x @ w)
        return x
    return forward, ws, (DENSE_WIDTH,)


def dense_by_neurons(devices: Sequence[str], rng):
    """The same MLP with every layer's matrix split by columns (output neurons): device ``i``
    computes half of each layer's outputs and needs *all* of the previous layer's outputs."""
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
    return forward, [w for layer in ws for w in layer], (DENSE_WIDTH,)


def _conv(x, w, pool: bool):
    y = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))
    return tf.nn.max_pool2d(y, 2, 2, "VALID") if pool else y


def two_tower_cnn(devices: Sequence[str], rng, cross: Sequence[int] = TOWER_CROSSINGS):
    """A small two-column CNN: one tower of channels per device, four conv layers then a fully
    connected one. A conv layer listed in ``cross`` reads both towers' previous outputs (the
    other tower's cross the link); the others read their own tower only. The fully connected
    layer always reads both towers' features. ``cross=TOWER_CROSSINGS`` is the split of
    Krizhevsky, Sutskever & Hinton 2012 (AlexNet); ``cross=(1, 2, 3)`` splits every layer by
    channels (the 'by neurons' split)."""
    d = list(devices[:2])
    kernels, c_in = [], CNN_INPUT[2]
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
    return forward, variables, CNN_INPUT


def cnn_by_layers(devices: Sequence[str], rng):
    """The same CNN, both towers' channels in one column (twice the channels per layer), split
    by layers: conv1 and conv2 on ``devices[0]``, conv3, conv4 and the fully connected layer on
    ``devices[1]``."""
    kernels, c_in = [], CNN_INPUT[2]
    for i, (k, c, _) in enumerate(CNN_LAYERS):
        kernels.append(_var(rng, (k, k, c_in, 2 * c), devices[int(i >= 2)]))
        c_in = 2 * c
    fc = _var(rng, (4 * 4 * c_in, 128), devices[1])

    def forward(x):
        for i, (_, _, pool) in enumerate(CNN_LAYERS):
            with tf.device(devices[int(i >= 2)]):
                x = _conv(x, kernels[i], pool)
        with tf.device(devices[1]):
            return tf.nn.relu(tf.reshape(x, (SPLIT_BATCH, -1)) @ fc)
    return forward, [*kernels, fc], CNN_INPUT


SPLITS = {  # name -> builder(devices, rng) -> (forward, variables, input shape per example)
    "dense, split by layers": dense_by_layers,
    "dense, split by neurons": dense_by_neurons,
    "CNN, split by layers": cnn_by_layers,
    "CNN, two towers (AlexNet)": two_tower_cnn,
    "CNN, split by channels": lambda d, rng: two_tower_cnn(d, rng, (1, 2, 3)),
}


def _sgd_ops(forward, variables, x):
    """The ops of one SGD step on ``sum(forward(x))``. ``tf.gradients`` puts each gradient op
    on its forward op's device (``GradientTape.gradient`` would put them all under the device
    scope it is called in, and pull every activation there); each update runs where its
    variable lives."""
    out = forward(x)
    with tf.device(out.device):  # the loss where the output is
        loss = tf.reduce_sum(out)
    grads = tf.gradients(loss, variables)
    updates = []
    for g, v in zip(grads, variables, strict=True):
        with tf.device(v.device):
            updates.append(v.assign_sub(1e-3 * g, read_value=False))
    return tf.group(updates)


def split_bytes(name: str, devices: Sequence[str], seed: int = 0) -> dict[str, int]:
    """Bytes crossing devices in one SGD step of ``SPLITS[name]`` (a ``tf.function`` run once,
    counted from its partition graphs): forward, backward, total, and ``input`` (the batch
    itself sent to the second device, part of forward)."""
    forward, variables, shape = SPLITS[name](devices, np.random.default_rng(seed))

    @tf.function(autograph=False)
    def step(x):
        _sgd_ops(forward, variables, x)  # returns nothing: no value comes back
    moved = trace.transfers_of(step, tf.ones((SPLIT_BATCH, *shape)))
    out = trace.crossing_bytes(moved)
    out["input"] = sum(t.nbytes for t in moved if t.tensor == "x:0")
    return out


def split_overlap(name: str, devices: Sequence[str], seed: int = 0, warmup: int = 2,
                  runs: int = 3) -> dict[str, float]:
    """``overlap_of`` traced TF1 runs of one SGD step of ``SPLITS[name]`` (``FULL_TRACE`` step
    stats; the median of ``runs`` runs per figure): how much of the step both devices worked
    at once (had an op in flight on both)."""
    g = tf.Graph()
    with g.as_default():
        forward, variables, shape = SPLITS[name](devices, np.random.default_rng(seed))
        x = tf.compat.v1.placeholder(tf.float32, (SPLIT_BATCH, *shape), name="x")
        updates = _sgd_ops(forward, variables, x)
        init = tf.compat.v1.global_variables_initializer()
    feed = {x: np.ones((SPLIT_BATCH, *shape), np.float32)}
    with tf.compat.v1.Session(graph=g, config=placement.session_config()) as sess:
        sess.run(init)
        for _ in range(warmup):
            sess.run(updates, feed)
        found = [overlap_of(trace.busy_intervals(profile.traced_run(sess, updates, feed)[1],
                                                 devices[:2])) for _ in range(runs)]
    return {k: float(np.median([f[k] for f in found])) for k in found[0]}


def count_splits(devices: Sequence[str], overlap: bool = True) -> dict[str, dict]:
    """For each of ``SPLITS`` on two devices: ``split_bytes`` and (``overlap=True``)
    ``split_overlap`` of one traced step after one warm-up step."""
    if len(devices) < 2:
        raise ValueError(f"count_splits needs 2 devices, got {list(devices)}")
    out = {}
    for name in SPLITS:
        out[name] = split_bytes(name, devices[:2])
        if overlap:
            out[name].update(split_overlap(name, devices[:2], warmup=1, runs=1))
    return out


def format_splits(counts: dict[str, dict]) -> str:
    """``count_splits``'s result as a table: KiB forward (of which the input), backward, total;
    and, where traced, the share of a step during which both devices had an op in flight."""
    width = max(len(k) for k in counts)
    lines = [f"{'split':{width}}  {'forward':>9} {'(input)':>9} {'backward':>9} {'total':>9}"
             f"  {'both in flight':>14}"]
    for name, c in counts.items():
        cells = " ".join(f"{c[k] / 1024:>5.0f} KiB" for k in
                         ("forward", "input", "backward", "total"))
        busy = f"{c['both in flight']:>14.0%}" if "both in flight" in c else ""
        lines.append(f"{name:{width}}  {cells}  {busy}")
    return "\n".join(lines)



HYBRID_KINDS = ("boundary activations and their gradients", "weights read from their owner",
                "weight gradients sent to their owner", "batch and labels", "losses")


def hybrid_traffic(transfers: Sequence, replicas: Sequence[Sequence[str]]) -> dict[str, int]:
    """Bytes of a ``make_split_step(..., replicas=replicas)`` step's data transfers
    (``trace.transfers_of``) by kind, ``HYBRID_KINDS`` in order: a scalar is a loss; a piece of
    ``tf.split`` is batch and labels; inside one replica, a boundary activation or its gradient;
    between replicas, forward is a weight read from its owner, backward a gradient sent to it."""
    if isinstance(replicas, str) or not replicas or any(isinstance(r, str) or not r
                                                        for r in replicas):
        raise ValueError(f"replicas must be a non-empty list of device lists, got {replicas!r}")
    owner = {d: r for r, devs in enumerate(replicas) for d in devs}
    if len(owner) != sum(len(devs) for devs in replicas):
        raise ValueError(f"a device is listed in two replicas: {replicas!r}")
    out = dict.fromkeys(HYBRID_KINDS, 0)
    for t in (t for t in transfers if not t.control):
        if t.source not in owner or t.target not in owner:
            raise ValueError(f"{t.tensor} goes from {t.source} to {t.target}: a device outside "
                             "the replicas")
        cross = owner[t.source] != owner[t.target]
        kind = (4 if t.shape is not None and len(t.shape) == 0 else
                3 if t.tensor.split("/")[-1].startswith("split") else
                0 if not cross else 1 if t.direction == "forward" else 2)
        out[HYBRID_KINDS[kind]] += t.nbytes
    return out


def format_hybrid_traffic(counts: dict[str, int]) -> str:
    """``hybrid_traffic``'s bytes, one kind per line, then their total."""
    rows = [*counts.items(), ("total", sum(counts.values()))]
    return "\n".join(f"{k:<41}  {v:>6,} bytes" for k, v in rows)
