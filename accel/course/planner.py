"""Chapter 17's planner sections: the planner's memory predictions next to the bytes the course
counts on its own devices (``memory_checks``) and next to a real Keras transformer block on a
logical device: its variables' bytes, the activations its tape keeps, the measured peak of a
step (``keras_block_check``), the step-time terms of a few plans as a figure (a cost model: fixed
data), the layouts ranked first under each assumption the model cannot settle
(``first_layouts``), and the exercises' checks."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from accel import models
from accel.costmodel import megatron_table as mt
from accel.costmodel import planner as pl
from accel.costmodel import plans

__all__ = ["CASES", "memory_checks", "keras_block", "keras_block_check", "fastest_layouts",
           "figure_terms", "ASSUMPTIONS", "first_layouts", "EXERCISES", "exercise_answer",
           "MEASURE_FIRST", "check_exercise"]

# the chapter's two questions: name -> (model, cluster, global batch)
CASES: dict[str, tuple[pl.Transformer, pl.Cluster, int]] = {
    "7.5B on 2 DGX A100": (pl.Transformer(36, 4096, 32, 2048, 51200),
                           pl.Cluster.dgx_a100(nodes=2), 64),
    "39.1B on 8 DGX A100": (pl.Transformer(48, 8192, 64, 2048, 51200),
                            pl.Cluster.dgx_a100(nodes=8), 512),
}


def memory_checks(device_names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """name -> (planner's bytes, bytes counted from real tensors): a Keras MLP's weights, the
    gradients a tape returns and Adam's moment variables (chapter 04's model); the weights of
    chapter 09's layers split over 3 devices (on each) and of one device's tensor-parallel shard
    of chapter 11's block; and weights, gradients and optimizer variables of one device under
    chapter 15's ZeRO stages 1-3 on 4 devices."""
    import keras
    import tensorflow as tf

    from accel.course import model_parallel as course09
    from accel.course.zero import mlp_layer_fns
    from accel.parallel import megatron
    from accel.parallel import model as mp
    from accel.parallel.layers import mlp_layers
    from accel.parallel.zero import ZeroStep
    from accel.training import squared_error

    out = {}
    net = models.keras_mlp([32, 64, 64, 10])
    with tf.GradientTape() as tape:  # real gradient tensors and Adam's real moment variables
        loss = tf.reduce_sum(net(tf.ones((2, 32))))
    grads = tape.gradient(loss, net.trainable_variables)
    adam = keras.optimizers.Adam()
    adam.build(net.trainable_variables)
    counted = sum(int(np.size(v)) * 4 for v in [*net.trainable_variables, *grads])
    counted += sum(int(np.size(v)) * 4 for v in adam.variables if len(v.shape) > 0)
    out["ch04 MLP, Adam: weights + grads + moments"] = (
        int(sum(pl.state_bytes(net.count_params(), "fp32"))), counted)
    sizes = [8, 16, 16, 16, 4]
    split = mp.split(mlp_layers(sizes), device_names[:3], [8])
    mem = course09.memory_per_device(mp.SplitModel(split))
    params = [a * b + b for a, b in zip(sizes, sizes[1:], strict=False)]
    for dev, parts in zip(split.devices, pl.stage_state_bytes(params, split.balance, "fp32"),
                          strict=True):
        out[f"ch09 split, {dev[-5:]}: weights"] = (int(parts[0]), mem[dev]["split"].weights)
    for t in (2, 4):
        shard = megatron.shard(megatron.init_block(hidden=16, heads=4), t)[0]
        out[f"ch11 block over {t}, one device's weights"] = (
            int(pl.state_bytes(pl.layer_parameters(16, t), "fp32")[0]),
            4 * sum(int(np.size(v)) for v in shard.values()))
    arrays = models.mlp_init([8, 16, 4])  # 144 + 68 parameters: 4 equal slices, no padding
    for stage in (1, 2, 3):
        held = ZeroStep(arrays, device_names[:4], stage, squared_error,
                        layer_fns=mlp_layer_fns(arrays)).held_bytes()
        out[f"ch15 ZeRO {stage} over 4, one device"] = (
            int(sum(pl.state_bytes(144 + 68, "fp32", stage, 4))), held[device_names[0]]["total"])
    return out


def keras_block(hidden: int, heads: int, seq: int):
    """A GPT block as Keras layers (pre-LayerNorm attention and a 4h GELU MLP, with residuals):
    ``12 h^2 + 13 h`` parameters, eq. 2's per-layer count."""
    import keras

    inp = keras.Input((seq, hidden))
    x = keras.layers.LayerNormalization()(inp)
    x1 = inp + keras.layers.MultiHeadAttention(heads, hidden // heads)(x, x)
    y = keras.layers.LayerNormalization()(x1)
    y = keras.layers.Dense(4 * hidden, activation="gelu")(y)
    return keras.Model(inp, x1 + keras.layers.Dense(hidden)(y))


def keras_block_check(device: str, hidden: int = 128, heads: int = 4, seq: int = 128,
                      batch: int = 4, peak: bool = True) -> dict[str, tuple[float, float]]:
    """name -> (planner's bytes, bytes of the real thing) for ``keras_block`` built on
    ``device`` and trained with Adam in float32: weights, Adam's slots and gradients counted
    from the tensors on ``device``; the activations the step's tape keeps (counted in its
    graph, ``accel.memory.measure.tape_kept_bytes``) against Korthikanti et al.'s count; one
    step's peak (measured by the allocator: ``TF_CPU_ALLOCATOR_USE_BFC=true``) against the
    planner's total (left out with ``peak=False``)."""
    import keras
    import tensorflow as tf

    from accel.costmodel.transformer import layer_activation_bytes
    from accel.memory.measure import measure_step_peak, tape_kept_bytes

    keras.utils.set_random_seed(0)
    with tf.device(device):
        block = keras_block(hidden, heads, seq)
        opt = keras.optimizers.Adam()
        opt.build(block.trainable_variables)
        x = tf.random.normal((batch, seq, hidden))
        y = tf.random.normal((batch, seq, hidden))
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, block(x, training=True))
        grads = tape.gradient(loss, block.trainable_variables)

    def on_device(tensors):
        return sum(int(np.prod(t.shape)) * t.dtype.size for t in tensors
                   if t.device.endswith(device.split("device:")[-1]))

    slots = [v.value for v in opt.variables if len(v.shape)]  # not the step count, the rate
    w, g, o = pl.state_bytes(pl.layer_parameters(hidden, 1), "fp32")
    acts = 2 * layer_activation_bytes(batch, seq, hidden, heads)  # float32: twice 16-bit
    out = {"weights (variables on the device)": (w, on_device(v.value for v in
                                                               block.trainable_variables)),
           "gradients": (g, on_device(grads)),
           "Adam's moments": (o, on_device(slots)),
           "activations kept for the backward": (acts, tape_kept_bytes(block, x))}
    if peak:
        with tf.device(device):
            out["one step's peak (measured)"] = (w + g + o + acts, measure_step_peak(
                block, opt, x, y, keras.losses.MeanSquaredError()))
    return out


def fastest_layouts(case: str = "39.1B on 8 DGX A100", top: int = 5) -> list[plans.Evaluated]:
    """The ``top`` fastest (d, t, p) layouts of ``CASES[case]`` (default search), each with its
    first-ranked ZeRO stage, micro-batch size and recomputation choice."""
    if case not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")
    model, cluster, batch = CASES[case]
    seen, picked = set(), []
    for r in plans.rank_plans(model, cluster, batch):
        key = (r.plan.data, r.plan.tensor, r.plan.pipeline)
        if key not in seen:
            seen.add(key)
            picked.append(r)
    return picked[:top]


def figure_terms(case: str = "39.1B on 8 DGX A100", top: int = 5):
    """Stacked bars: each term of the modelled step of ``fastest_layouts(case, top)``: compute,
    tensor-parallel all-reduces, bubble, the pipeline's sends outside the bubble (``v m`` of
    them), data-parallel traffic (ZeRO 1: a reduce-scatter and an all-gather); the five add up
    to ``step_s``."""
    import matplotlib.pyplot as plt

    picked = fastest_layouts(case, top)
    labels = [f"d{r.plan.data} t{r.plan.tensor} p{r.plan.pipeline}" for r in picked]
    terms = {"compute": [r.time.compute_s for r in picked],
             "tensor all-reduces": [r.time.tensor_s for r in picked],
             "bubble": [r.time.bubble_s for r in picked],
             "pipeline sends": [r.time.step_s - r.time.compute_s - r.time.tensor_s
                                - r.time.bubble_s - r.time.data_s for r in picked],
             "data-parallel traffic": [r.time.data_s for r in picked]}
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    bottom = np.zeros(len(picked))
    for name, values in terms.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom += np.array(values)
    ax.set_ylabel("seconds per step (MODEL)")
    ax.set_title(f"{case}: where a step's time goes, fastest layouts first")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# exercise 3: what the model assumes and cannot settle, as ``plans.rank_plans`` arguments on top
# of ``plans.LATER``: the data-parallel traffic hidden not at all or in full (section 3's two
# bounds), compute at the planner's share of the peak (``pl.UTILIZATION``, which section 6's fit
# on Table 1 confirms) or at the best A100 bf16 matmul's (``mt.GEMM_CEILING``: 267.9 of the
# A100's 312 TFLOP/s, ``accel.costmodel.hardware``), the most a step could reach
_CEILING = mt.GEMM_CEILING[0] * 1e12 / pl.Cluster.dgx_a100(nodes=1).peak_flops
ASSUMPTIONS: dict[str, dict] = {
    "no overlap, utilisation 0.5": {"overlap": (False,), "utilization": pl.UTILIZATION},
    "overlap in full, utilisation 0.5": {"overlap": (False, True),
                                         "utilization": pl.UTILIZATION},
    "no overlap, best matmul's share": {"overlap": (False,), "utilization": _CEILING},
    "overlap in full, best matmul's share": {"overlap": (False, True), "utilization": _CEILING},
}


def first_layouts(case: str = "39.1B on 8 DGX A100",
                  assumptions: dict[str, dict] | None = None) -> dict[str, tuple[int, int, int]]:
    """name -> the (tensor, pipeline, ZeRO stage) of the plan ``plans.rank_plans`` puts first
    for ``CASES[case]`` with ``plans.LATER``'s search under each of ``assumptions`` (default
    ``ASSUMPTIONS``: a dict of ``rank_plans`` keyword arguments that override the search)."""
    if case not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")
    if assumptions is None:  # the four rankings take seconds: computed once per case
        return dict(_first_layouts_default(case))
    if not isinstance(assumptions, dict) or not assumptions:
        raise ValueError(f"assumptions must be a non-empty dict of name -> rank_plans "
                         f"arguments, got {assumptions!r}")
    return _first_layouts(case, assumptions)


@functools.cache
def _first_layouts_default(case: str) -> tuple:
    return tuple(_first_layouts(case, ASSUMPTIONS).items())


def _first_layouts(case: str, assumptions: dict) -> dict[str, tuple[int, int, int]]:
    model, cluster, batch = CASES[case]
    out = {}
    for name, args in assumptions.items():
        if not isinstance(args, dict):
            raise ValueError(f"assumption {name!r} must be a dict of rank_plans arguments, "
                             f"got {args!r}")
        first = plans.rank_plans(model, cluster, batch, **{**plans.LATER, **args})[0].plan
        out[name] = (first.tensor, first.pipeline, first.zero)
    return out


# the exercises: (question name) -> (model, cluster, global batch, search options, precision)
EXERCISES: dict[str, tuple] = {
    "18 bytes per parameter": (*CASES["39.1B on 8 DGX A100"], {}, "megatron-bf16"),
    "later options, 18.4B": (pl.Transformer(40, 6144, 48, 2048, 51200),
                             pl.Cluster.dgx_a100(nodes=32), 1024,
                             dict(plans.LATER, zero_stages=(0,), overlap=(False,)), "mixed"),
}


# exercise 3 (name -> the case whose first layouts under ``ASSUMPTIONS`` are the answer)
MEASURE_FIRST = {"three benchmark runs": "39.1B on 8 DGX A100"}


def exercise_answer(name: str):
    """The (tensor, pipeline) pair the planner ranks first for ``EXERCISES[name]``; for
    ``MEASURE_FIRST[name]``, the set of (tensor, pipeline, ZeRO stage) layouts that some
    assumption of ``ASSUMPTIONS`` ranks first."""
    if name in MEASURE_FIRST:
        return frozenset(first_layouts(MEASURE_FIRST[name]).values())
    if name not in EXERCISES:
        raise ValueError(f"exercise must be one of {sorted([*EXERCISES, *MEASURE_FIRST])}, "
                         f"got {name!r}")
    model, cluster, batch, search, precision = EXERCISES[name]
    first = plans.rank_plans(model, cluster, batch, precision=precision, **search)[0].plan
    return first.tensor, first.pipeline


def _as_layout_set(answer) -> frozenset | None:
    """A set, list or tuple of tuples / lists as a set of tuples (order-free); None otherwise."""
    if not isinstance(answer, set | frozenset | list | tuple):
        return None
    if not all(isinstance(x, tuple | list) for x in answer):
        return None
    return frozenset(tuple(x) for x in answer)


def check_exercise(name: str, answer) -> str:
    """``answer``: the (tensor, pipeline) pair you predict, then find, for ``EXERCISES[name]``;
    for ``MEASURE_FIRST[name]``, the (tensor, pipeline, ZeRO stage) layouts, in any order."""
    if answer is None:
        return f"exercise '{name}': not answered yet"
    expected = exercise_answer(name)  # raises for an unknown name
    if name in MEASURE_FIRST:
        ok = _as_layout_set(answer) == expected
    else:
        ok = isinstance(answer, tuple | list) and tuple(answer) == expected
    return f"exercise '{name}': " + ("correct" if ok else "not quite, try again")
