"""Chapter 11's experiments: tensor-parallel training steps (by hand and with DTensor) ready to
time, the bytes they send, the ``tensor-parallel`` benchmark and the chapter's figures.

* ``train_steps(device_names, n, kind, ...)``: zero-argument SGD steps, single device vs
  tensor parallel by hand over ``n`` devices (and DTensor for the MLP), each returning the loss;
* ``counted_bytes(device_names, n, kind, ...)``: bytes each device sent in one forward + backward
  (input gradient included), counted in the graph that ran, next to the formula;
* ``bytes_by_device(variables)``: the bytes each device holds, read from the variables;
* ``bench(device_names, quick=False)``: ``python -m accel bench tensor-parallel``;
* ``figure_sequence_parallel()``: the chapter's diagram of sequence parallelism;
* ``activation_table(...)``: one layer's kept activations per device under TP, TP + SP and
  TP + SP + CP, scores kept or attention fused (Korthikanti et al.'s terms);
* ``tp_efficiency(...)``: the layer model's efficiency on any link (NVLink 5 and Infinity Fabric
  included) at its nominal or an achievable bandwidth;
* ``check_tp_vs_dp``, ``check_attention_split``, ``check_keras_held``: the exercises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from accel import collectives, timing
from accel.parallel import megatron as tp
from accel.parallel import mesh as dmesh

__all__ = ["MLP_KEYS", "params_for", "train_steps", "counted_bytes", "time_steps", "bench",
           "bytes_by_device", "check_tp_vs_dp", "check_attention_split", "check_keras_held",
           "activation_table", "LAYOUTS", "tp_efficiency", "LLAMA3_70B_LAYER", "TP_VS_DP_CASES",
           "figure_sequence_parallel", "mlp_layouts", "MEGATRON_SOURCE",
           "MEGATRON_WEAK_SCALING"]

MLP_KEYS = ("w1", "b1", "w2", "b2")
MEGATRON_SOURCE = ("NVIDIA ADLR, 'MegatronLM's Supercharged V1.0' (nv-adlr.github.io/MegatronLMV1),"
                   " Table 1: GPT-2 models, batch 8, DGX-2H (V100, NVSwitch), weak scaling")
# REPORTED (not measured here): model-parallel GPUs -> (parameters in billions, % of linear)
MEGATRON_WEAK_SCALING: dict[int, tuple[float, float]] = {
    1: (1.2, 100.0), 2: (2.0, 90.7), 4: (4.2, 86.5), 8: (8.7, 79.6)}


def mlp_layouts(mesh, model: str = "model", wrong: bool = False) -> dict:
    """Megatron's split of the MLP over mesh axis ``model``: ``w1`` by columns (with ``b1``),
    ``w2`` by rows, ``b2`` replicated. ``wrong=True`` swaps them (``w1`` by rows, ``w2`` by
    columns): still correct, but DTensor must move data to make it so."""
    col, row = [None, model], [model, None]
    if wrong:
        col, row = row, col
    return {"w1": dmesh.layout(mesh, col), "b1": dmesh.layout(mesh, [None if wrong else model]),
            "w2": dmesh.layout(mesh, row), "b2": dmesh.layout(mesh, [model if wrong else None])}


def params_for(kind: str, hidden: int, heads: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 parameters of the MLP (``kind="mlp"``) or the whole block."""
    p = tp.init_block(hidden, heads, seed=seed)
    return {k: p[k] for k in MLP_KEYS} if kind == "mlp" else p


def _loss(o, t):
    return tf.reduce_mean((o - t) ** 2)


def train_steps(device_names: Sequence[str], n: int, kind: str = "mlp", batch: int = 8,
                seq: int = 64, hidden: int = 256, heads: int = 8, lr: float = 0.01,
                dtensor_too: bool = True, *, local_update: bool = False
                ) -> dict[str, Callable[[], float]]:
    """SGD steps on the same data and initial weights: ``single`` (all on device 0), ``hand``
    (``tp_mlp`` / ``tp_block`` over the first ``n`` devices) and, for the MLP, ``dtensor`` (the
    single-device code on a 1-D mesh of the same devices, Megatron layouts). Each is a whole
    training step: forward, backward and update.

    ``local_update``: ``True`` runs each shard's SGD update on the device that holds the shard,
    as DTensor's update runs on every device of the mesh (the fair race against DTensor, what
    ``bench`` times); ``False`` leaves the update ops where TensorFlow places them (the updates
    of the other devices' shards on the first device, and their gradients sent there and back)."""
    devs = list(device_names[:n])
    params = params_for(kind, hidden, heads)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, seq, hidden)).astype(np.float32)
    y = rng.standard_normal((batch, seq, hidden)).astype(np.float32)

    def one(p, v):
        return tp.mlp(p, v) if kind == "mlp" else tp.block(p, v, heads)

    def many(s, vs):
        return tp.tp_mlp(s, vs, devs) if kind == "mlp" else tp.tp_block(s, vs, devs, heads)

    with tf.device(devs[0]):
        single_v = {k: tf.Variable(a) for k, a in params.items()}
        xt, yt = tf.constant(x), tf.constant(y)

    @tf.function(autograph=False)
    def single():
        with tf.device(devs[0]), tf.GradientTape() as tape:
            loss = _loss(one(single_v, xt), yt)
            grads = tape.gradient(loss, single_v)
        for k, g in grads.items():
            single_v[k].assign_sub(lr * g)
        return loss

    shards = tp.to_variables(tp.shard(params, n, heads if kind == "block" else None), devs)
    xs, ys = collectives.place(x, devs), collectives.place(y, devs)

    @tf.function(autograph=False)
    def hand():
        with tf.GradientTape() as tape:
            outs = many(shards, xs)
            losses = [collectives.on_device(_loss, d, o, t)
                      for o, t, d in zip(outs, ys, devs, strict=True)]
        grads = tape.gradient(losses, shards)
        for s, g, d in zip(shards, grads, devs, strict=True):
            with tf.device(d) if local_update else contextlib.nullcontext():
                for k in s:
                    s[k].assign_sub(lr * g[k])
        return losses[0]

    steps = {"single": lambda: float(single()), "hand": lambda: float(hand())}
    if kind == "mlp" and dtensor_too:
        mesh = dmesh.make_mesh(devs, {"model": n})
        dv = dmesh.variables(params, mlp_layouts(mesh))
        rep = dmesh.layout(mesh, [None, None, None])
        xd, yd = dmesh.put(x, rep), dmesh.put(y, rep)

        @tf.function(autograph=False)
        def dtensor_step():
            with tf.GradientTape() as tape:
                loss = _loss(tp.mlp(dv, xd), yd)
            grads = tape.gradient(loss, dv)
            for k, g in grads.items():
                dv[k].assign_sub(lr * g)
            return loss

        steps["dtensor"] = lambda: float(dmesh.fetch(dtensor_step()))
    return steps


def counted_bytes(device_names: Sequence[str], n: int, kind: str = "mlp", batch: int = 8,
                  seq: int = 64, hidden: int = 256, heads: int = 8,
                  sequence_parallel: bool = False, algorithm: str = "direct") -> dict[str, int]:
    """Bytes each device sent in one forward + backward of the tensor-parallel layer (with the
    input's gradient, as inside a stack), counted from the ``_Send`` nodes that ran, and the
    formula ``tp.bytes_per_step``: ``{"counted_min", "counted_max", "formula"}``.

    ``algorithm`` is the all-reduce's ("direct" or "ring", ``accel.collectives.ALGORITHMS``);
    with ``sequence_parallel`` each device starts from its ``seq / n`` positions and the layer
    runs with Korthikanti et al.'s all-gather / reduce-scatter (``tp.tp_mlp`` / ``tp.tp_block``
    with ``sequence_parallel=True``)."""
    devs = list(device_names[:n])
    shards = tp.to_variables(tp.shard(params_for(kind, hidden, heads), n), devs)
    x = np.ones((batch, seq, hidden), np.float32)
    if sequence_parallel and seq % n:
        raise ValueError(f"seq={seq} is not divisible by n={n} devices")
    xs = collectives.place(np.split(x, n, axis=1) if sequence_parallel else x, devs)

    def step(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            outs = (tp.tp_mlp(shards, xs, devs, sequence_parallel, algorithm) if kind == "mlp"
                    else tp.tp_block(shards, xs, devs, heads, sequence_parallel, algorithm))
            losses = [collectives.on_device(tf.reduce_sum, d, o) for o, d in zip(outs, devs,
                                                                                   strict=True)]
        return tape.gradient(losses, [xs, shards])

    sent = collectives.sent_bytes(step, xs)
    return {"counted_min": min(sent.values()), "counted_max": max(sent.values()),
            "formula": tp.bytes_per_step(kind, [batch, seq, hidden], n,
                                         sequence_parallel=sequence_parallel,
                                         algorithm=algorithm)}


def bytes_by_device(variables) -> dict[str, int]:
    """Bytes of ``variables`` (``tf.Variable``s or Keras variables, e.g. a model's and its
    optimizer's) on each device, each read from where the variable itself lives."""
    import keras

    from accel.placement import short_device

    held: dict[str, int] = {}
    for v in variables:
        device = short_device((v.value if isinstance(v, keras.Variable) else v).device)
        size = int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size  # Keras: dtype is a string
        held[device] = held.get(device, 0) + size
    return dict(sorted(held.items()))


def time_steps(steps: dict, rounds: int = 3, repeat: int = 5, warmup: int = 1
               ) -> dict[str, float]:
    """Median seconds of each zero-argument step, timed in interleaved rounds (``rounds`` x
    ``repeat`` calls each) after ``warmup`` untimed calls of each (the first one traces):
    ``accel.timing.interleaved_medians``."""
    return timing.interleaved_medians(steps, rounds, repeat, warmup)


def bench(device_names: Sequence[str], quick: bool = False) -> dict:
    """Step time of the tensor-parallel MLP and block (by hand, n = 2, 4) vs one device, DTensor
    vs by hand on the same MLP (goal: by hand within 1.1x of DTensor), and bytes per step vs the
    formula.

    Each step is a whole SGD training step (forward, backward, update; ``train_steps`` with
    ``local_update=True``, so that the hand-written update runs on each shard's device as
    DTensor's does) on the same weights, data and devices, its loss fetched as a number. The
    steps of each comparison are built first, get the same ``warmup`` untimed calls (the first
    one traces), then are timed in interleaved rounds (``time_steps``). Returns
    ``{"<kind>_<variant>_<n>": seconds, "<kind>_hand/single_<n>", "<kind>_hand/dtensor_<n>":
    ratios, "<kind>_bytes_<n>", "ceiling", "warmup", "rounds", "repeat"}``."""
    size = dict(batch=2, seq=8, hidden=32, heads=4) if quick else {}
    warmup, rounds, repeat = (1, 1, 1) if quick else (2, 6, 3)
    out: dict[str, float] = {"warmup": warmup, "rounds": rounds, "repeat": repeat}
    lines = [f"median time of one SGD step (forward, backward, update) after {warmup} untimed "
             f"steps each, {rounds} interleaved rounds of {repeat}; ratios against the same "
             "run's single-device step and DTensor step"]
    for kind in ("mlp", "block"):
        for n in (2,) if quick else (2, 4):
            t = time_steps(train_steps(device_names, n, kind, **size, local_update=True),
                           rounds, repeat, warmup)
            out.update({f"{kind}_{v}_{n}": seconds for v, seconds in t.items()})
            out[f"{kind}_hand/single_{n}"] = t["hand"] / t["single"]
            line = (f"{kind:5} n={n}: single {t['single'] * 1e3:7.2f} ms  by hand "
                    f"{t['hand'] * 1e3:7.2f} ms  ({out[f'{kind}_hand/single_{n}']:.2f}x)")
            if "dtensor" in t:
                out[f"{kind}_hand/dtensor_{n}"] = t["hand"] / t["dtensor"]
                line += (f"  DTensor {t['dtensor'] * 1e3:7.2f} ms  by hand / DTensor "
                         f"{out[f'{kind}_hand/dtensor_{n}']:.2f}")
            lines.append(line)
            b = counted_bytes(device_names, n, kind, **size)
            out[f"{kind}_bytes_{n}"] = b["counted_max"]
            same = b["counted_min"] == b["counted_max"] == b["formula"]
            lines.append(f"{'':13}bytes sent per device per step: counted {b['counted_min']}"
                         f"..{b['counted_max']}, formula {b['formula']}"
                         f" ({'equal' if same else 'DIFFERENT'})")
    worst = max(v for k, v in out.items() if "/dtensor" in k)
    lines.append(f"goal: by hand within 1.1x of DTensor -> worst {worst:.2f} "
                 f"({'met' if worst <= 1.1 else 'NOT met'})")
    measured = timing.measure_ceiling()
    out["ceiling"] = measured.value
    lines.append(timing.ceiling_line(measured) + "; virtual CPUs share these cores")
    print("\n".join(lines))
    return out


def tp_efficiency(batch: int, seq: int, hidden: int, n: int, device: str, link: str,
                  precision: str = "fp16", utilization: float = 0.5,
                  link_gbs: float | None = None) -> float:
    """MODEL: the efficiency ``t_1 / (n t_n)`` of ``accel.costmodel.tensor_parallel.tp_layer_time``
    (matmuls at ``utilization`` of ``device``'s dense peak, attention-score FLOPs left out, four
    ring all-reduces, no overlap) for ``link`` a key of ``accel.costmodel.hardware.LINKS`` or of
    ``accel.costmodel.collectives.CURRENT_LINKS`` (NVLink 5, Infinity Fabric), at the link's
    nominal one-direction bandwidth or at ``link_gbs`` GB/s where given (an achievable bus
    bandwidth, as nccl-tests reports it)."""
    from accel.costmodel.collectives import link_spec
    from accel.costmodel.hardware import peak_flops
    from accel.costmodel.tensor_parallel import tp_bytes_per_layer
    from accel.costmodel.transformer import layer_flops
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) \
            or not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    gbs = link_spec(link).value if link_gbs is None else link_gbs
    if isinstance(gbs, bool) or not isinstance(gbs, int | float) or gbs <= 0:
        raise ValueError(f"link_gbs must be a positive number of GB/s, got {link_gbs!r}")
    compute_1 = layer_flops(batch, seq, hidden, attention_scores=False) / (
        peak_flops(device, precision) * utilization)
    comm = tp_bytes_per_layer(batch, seq, hidden, n) / (gbs * 1e9)
    return compute_1 / (n * (compute_1 / n + comm))


# exercise 1: one layer of Llama 3 70B (Dubey et al. 2024, arXiv:2407.21783, Table 3: model
# dimension 8,192, FFN 28,672, 64 attention heads, 8 KV heads; head dimension 8192 / 64 = 128;
# SwiGLU: three FFN matrices; two RMSNorm gains, no biases)
LLAMA3_70B_LAYER = {"wq": (8192, 8192), "wk": (8192, 1024), "wv": (8192, 1024),
                    "wo": (8192, 8192), "w1": (8192, 28672), "w3": (8192, 28672),
                    "w2": (28672, 8192), "norm1": (8192,), "norm2": (8192,)}
# case -> (sequences of 8,192 tokens per micro-batch, all-reduce algorithm for both sides)
TP_VS_DP_CASES = {"A": (1, "ring"), "B": (4, "direct"), "C": (3, "ring")}


def _tp_vs_dp(sequences: int, algorithm: str, n: int = 8, itemsize: int = 2) -> dict:
    """Bytes one device sends per layer and step: tensor parallelism's four all-reduces of the
    ``[sequences, 8192, 8192]`` activation, data parallelism's one all-reduce of the layer's
    gradients (``LLAMA3_70B_LAYER``), both 16-bit, by ``algorithm``."""
    params = sum(int(np.prod(shape)) for shape in LLAMA3_70B_LAYER.values())
    act = sequences * 8192 * 8192 * itemsize
    return {"tensor": 4 * collectives.all_reduce_bytes(act, n, algorithm),
            "data": collectives.all_reduce_bytes(params * itemsize, n, algorithm)}


def check_tp_vs_dp(answer) -> str:
    """Exercise 1: for each case of ``TP_VS_DP_CASES``, which of ``"tensor"`` and ``"data"``
    parallelism sends more bytes per device per layer and step; ``answer`` a dict case -> side."""
    if answer is None or answer is ...:
        return "exercise 1: not answered yet (set answer1 to a dict: case -> side)"
    if not isinstance(answer, dict) or set(answer) != set(TP_VS_DP_CASES):
        return (f"exercise 1: answer1 should be a dict with keys {sorted(TP_VS_DP_CASES)}, "
                f"got {answer!r}")
    bad = {k: v for k, v in answer.items() if v not in ("tensor", "data")}
    if bad:
        return f"exercise 1: each side must be 'tensor' or 'data', got {bad}"
    sent = {k: _tp_vs_dp(*case) for k, case in TP_VS_DP_CASES.items()}
    right = {k: max(b, key=b.get) for k, b in sent.items()}
    wrong = sorted(k for k in answer if answer[k] != right[k])
    if wrong:
        return f"exercise 1: not quite: case(s) {', '.join(wrong)}; the others are right"
    return ("exercise 1: correct: " + "; ".join(
        f"{k}: tensor {b['tensor'] / 1e9:.2f} GB, data {b['data'] / 1e9:.2f} GB"
        for k, b in sent.items()) + ". Both sides use the same algorithm, so it scales both "
        "alike; the layer holds 855,654,400 weights (GQA's small K/V, SwiGLU's third matrix), "
        "not 12h^2 = 805,306,368, so at 3 x 8,192 tokens, where 12h^2 says a tie, data "
        "parallelism sends more")


LAYOUTS = ("TP", "TP+SP", "TP+SP+CP")


def activation_table(seq: int, hidden: int, heads: int, tensor: int, context: int,
                     batch: int = 1) -> dict[str, dict[str, float]]:
    """A MODEL: bytes one transformer layer keeps for its backward pass on one device (16-bit,
    no recomputation, per micro-batch), for each of ``LAYOUTS`` with attention's scores kept
    (``"materialized"``) or a fused kernel (``"fused"``).

    Korthikanti et al. 2022 (arXiv:2205.05198): TP ``s b h (10 + 24 / t + 5 a s / (h t))``
    (section 4.2.1), TP + SP ``s b h / t (34 + 5 a s / h)`` (section 4.2.2). Context
    parallelism over ``c`` devices (``context``) keeps ``s / c`` positions of every activation,
    and each device's queries meet all ``s`` keys, so its scores are ``5 a (s / c) s b / t``
    bytes: ``s b h / (t c) (34 + 5 a s / h)``. A fused kernel (Dao et al. 2022,
    arXiv:2205.14135) keeps no scores, only a float32 log-sum-exp per head and query: the
    ``5 a s / h`` term becomes ``4 a / h`` (as ``accel.costmodel.planner.layer_activations``)."""
    for name, v in (("seq", seq), ("hidden", hidden), ("heads", heads), ("tensor", tensor),
                    ("context", context), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if heads % tensor:
        raise ValueError(f"tensor={tensor} must divide heads={heads} (it splits whole heads)")
    if seq % context:
        raise ValueError(f"context={context} must divide seq={seq}")
    s, b, h, a, t, c = seq, batch, hidden, heads, tensor, context
    sbh = s * b * h
    out = {}
    for attention, scores in (("materialized", 5 * a * s / h), ("fused", 4 * a / h)):
        out[attention] = {"TP": sbh * (10 + 24 / t + scores / t),
                          "TP+SP": sbh / t * (34 + scores),
                          "TP+SP+CP": sbh / (t * c) * (34 + scores)}
    return {layout: {att: out[att][layout] for att in out} for layout in LAYOUTS}


# exercise 2: (query heads, KV heads, sequence, devices for attention, what is already split)
ATTENTION_CASES = {
    "A": "32 heads, 32 KV heads, sequence 4,096, 8 GPUs of one NVLink server, nothing split yet",
    "B": "64 heads, 8 KV heads, sequence 131,072, tensor parallelism 8 inside each server; "
         "split attention 2 more ways, across two servers",
    "C": "32 heads, 32 KV heads, sequence 131,072, no tensor parallelism; split the sequence "
         "8 ways inside one NVSwitch server, with an attention kernel that cannot overlap "
         "communication with compute",
}
_ATTENTION_RIGHT = {"A": {"tensor"}, "B": {"ring", "all_gather"}, "C": {"ulysses"}}
_ATTENTION_WHY = {
    "A": "a short sequence: activations are small, and the weights are what a split must divide",
    "B": "past 8 KV heads tensor parallelism cannot go, and 8 / 8 = 1 KV head per rank cannot be "
         "split 2 more ways by Ulysses; ring (or K/V all-gathered) needs no head count",
    "C": "heads divide by 8, and with nothing hidden behind compute the bytes decide: Ulysses "
         "sends n / 2 = 4 times less than the ring or the all-gather",
}
ATTENTION_CHOICES = ("tensor", "ring", "all_gather", "ulysses")


def check_attention_split(answer) -> str:
    """Exercise 2: for each case of ``ATTENTION_CASES`` the split of attention to choose, one of
    ``ATTENTION_CHOICES``; ``answer`` is a dict case -> choice."""
    if answer is None or answer is ...:
        return "exercise 2: not answered yet (set answer2 to a dict: case -> choice)"
    if not isinstance(answer, dict) or set(answer) != set(ATTENTION_CASES):
        return (f"exercise 2: answer2 should be a dict with keys {sorted(ATTENTION_CASES)}, "
                f"got {answer!r}")
    bad = {k: v for k, v in answer.items() if v not in ATTENTION_CHOICES}
    if bad:
        return f"exercise 2: each choice must be one of {list(ATTENTION_CHOICES)}, got {bad}"
    wrong = sorted(k for k, v in answer.items() if v not in _ATTENTION_RIGHT[k])
    if wrong:
        return f"exercise 2: not quite: case(s) {', '.join(wrong)}; the others are right"
    return "exercise 2: correct: " + "; ".join(f"{k}: {why}" for k, why in
                                              _ATTENTION_WHY.items())


def keras_block_bytes(n: int, width: int = 16, heads: int = 4, mlp: int = 64,
                      itemsize: int = 8, copies: int = 3) -> int:
    """Bytes a device other than the first holds for the chapter's Keras block split over
    ``n`` devices: its heads' query/key/value kernels and biases and output-kernel rows, its
    columns of ``up`` (with their bias) and rows of ``down``, each held ``copies`` times
    (weight + Adam's two slots)."""
    key_dim, h, cols = width // heads, heads // n, mlp // n
    attention = 3 * (width * h * key_dim + h * key_dim) + h * key_dim * width
    return (attention + width * cols + cols + cols * width) * itemsize * copies


def check_keras_held(answer) -> str:
    """Exercise 3: bytes ``/device:CPU:1`` holds for section 7's Keras block split over 2
    devices, weights and Adam's slots, float64."""
    if answer is None or answer is ...:
        return "exercise 3: not answered yet (set answer3 to a number of bytes)"
    if not isinstance(answer, int) or answer < 0:
        return f"exercise 3: answer3 should be a whole number of bytes, got {answer!r}"
    right = keras_block_bytes(2)
    if answer == right:
        return (f"exercise 3: correct: {right} B, twice what it held on 4 devices "
                f"({keras_block_bytes(4)} B): each shard is twice as large")
    if answer == keras_block_bytes(2, copies=1):
        return "exercise 3: not quite: that is the weights alone; Adam keeps two slots each"
    return f"exercise 3: not quite: {answer} is {'too high' if answer > right else 'too low'}"


def figure_sequence_parallel():
    """Megatron's tensor + sequence parallelism over 2 devices (Korthikanti et al. 2022, Figure
    5): what each device holds in each region: half the positions (the sequence-parallel
    LayerNorm and dropout regions), or all positions with half the attention heads or half the
    MLP's hidden columns (the tensor-parallel regions)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.8))
    # (name, what each device holds): sequence-parallel regions hold half the positions; the
    # tensor-parallel ones all positions and half the heads, or half the MLP's hidden columns
    stages = [("LayerNorm\n+ dropout", "seq", "sequence half"),
              ("attention", "tp", "all positions,\nhalf the heads"),
              ("LayerNorm\n+ dropout", "seq", "sequence half"),
              ("MLP", "tp", "all positions, half of\nw1's columns / w2's rows")]
    # Megatron's names (section 4): f before a column-parallel layer, g after a row-parallel one
    between = ["all-gather\n(replaces f)", "reduce-scatter\n(replaces g)",
               "all-gather\n(replaces f)", "reduce-scatter\n(replaces g)"]
    colors = {"seq": "#8fbc8f", "tp": "#87a9d6"}
    for i, (name, split, part) in enumerate(stages):
        x0 = i * 2.6
        for dev in range(2):
            y0 = 1.1 - dev * 1.0
            ax.add_patch(plt.Rectangle((x0, y0), 1.8, 0.8, color=colors[split], alpha=0.8))
            ax.text(x0 + 0.9, y0 + 0.4, f"{name}\ndevice {dev}: {part}", ha="center",
                    va="center", fontsize=6.5)
        ax.annotate(between[i], (x0 + 2.2, 1.0), ha="center", va="center", fontsize=6.5)
    ax.set(xlim=(-0.2, 10.6), ylim=(-0.1, 2.1), title="sequence parallelism: the parts that "
           "tensor parallelism leaves replicated are split along the sequence")
    ax.axis("off")
    fig.tight_layout()
    return fig
