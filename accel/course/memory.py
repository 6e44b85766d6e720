"""Chapters 04 and 05's experiments: the memory benchmark and its ratio figure, one step's memory
timeline read from the profiler (``step_memory_timeline``, drawn by ``figure_memory_timeline``),
the inter-op overlap probe, the cost models of a transformer's training memory and of
recomputation, and the exercise checks (each returns "exercise N: not answered yet" for
``None``, "correct ..." or what is still wrong; the solutions live in
``tests/course/test_memory.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

from accel import checks, profile
from accel.costmodel import transformer as transformer_cost
from accel.memory.estimate import MIB
from accel.memory.measure import memory_device, peak_during, tape_kept_bytes
from accel.memory.savings import gradient_step, measure_variants_anywhere, residual_mlp
from accel.memory.savings import ratios as variant_ratios
from accel.timing import format_ratios

__all__ = ["bench_memory", "process_threads", "process_rss", "two_chains",
           "overlapping_pairs", "step_memory_timeline",
           "figure_memory_timeline", "MIXED_ADAM_BYTES", "MEGATRON_BF16_BYTES",
           "transformer_memory", "recomputation_plans", "check_one_buffer", "check_plan_fits",
           "check_half_pays", "check_overflow_steps", "check_xla_compilations"]


def bench_memory(device_names: Sequence[str] = (), quick: bool = False) -> dict:
    """Peak memory and step time: plain vs recompute vs mixed precision (ratios vs plain),
    measured in a fresh process (small tensors otherwise come from chunks the allocator pooled
    for earlier work in this one, and the peaks depend on that work). ``device_names`` is
    accepted for the benchmark registry's uniform signature."""
    results = measure_variants_anywhere(fresh=True, batch=64 if quick else 1024,
                                        blocks=2 if quick else 16, width=64,
                                        repeat=1 if quick else 7)
    ratios = variant_ratios(results)
    print(format_ratios({k: v["seconds"] for k, v in results.items()}, "plain"))
    for name, r in ratios.items():
        print(f"{name:10s} peak {results[name]['peak_mib']:7.2f} MiB  {r['peak_mib']:5.2f}x plain")
    return {"results": results, "ratios": ratios}


def process_threads() -> int:
    """Operating-system threads of this process now (every thread of TensorFlow's pools counts)."""
    import psutil  # comes with ipykernel

    return psutil.Process().num_threads()


def process_rss() -> int:
    """Resident bytes of this process now: pages it holds, whatever its allocators think."""
    import psutil

    return psutil.Process().memory_info().rss


def two_chains(n: int = 384, depth: int = 8):
    """A TF1 graph of two independent chains of ``depth`` ``tanh(h @ h)`` steps on ``n`` x ``n``
    matrices, scopes ``chain0`` and ``chain1``; returns ``(graph, [sum0, sum1])``."""
    checks.positive_int("n", n)
    checks.positive_int("depth", depth)
    graph = tf.Graph()
    with graph.as_default():
        fetches = []
        for i in range(2):
            with tf.name_scope(f"chain{i}"):
                h = tf.random.normal((n, n), seed=i)
                for _ in range(depth):
                    h = tf.tanh(tf.matmul(h, h) / n)
                fetches.append(tf.reduce_sum(h))
    return graph, fetches


def overlapping_pairs(session, fetches) -> int:
    """Run ``fetches`` once with a full trace; count the pairs (chain0 matmul, chain1 matmul)
    whose execution intervals in the step stats intersect: 0 means the chains never ran at
    the same time."""
    meta = tf.compat.v1.RunMetadata()
    session.run(fetches, options=tf.compat.v1.RunOptions(trace_level=3), run_metadata=meta)
    spans: dict[str, list[tuple[int, int]]] = {"chain0": [], "chain1": []}
    for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
            scope = node.node_name.split("/")[0]
            if scope in spans and "matmul" in node.node_name.lower():
                start = node.all_start_micros
                spans[scope].append((start, start + node.all_end_rel_micros))
    return sum(min(a1, b1) > max(a0, b0)
               for a0, a1 in spans["chain0"] for b0, b1 in spans["chain1"])


def step_memory_timeline(variant: str = "plain", batch: int = 1024, blocks: int = 8,
                         width: int = 128, logdir: str | None = None
                         ) -> list[profile.MemoryEvent]:
    """The allocator's record of one gradient step of ``accel.memory.savings``' residual MLP
    (``variant``: one of its ``VARIANTS``), read from a profiler trace
    (``accel.profile.read_trace``, kept under ``logdir`` if given;
    ``accel.profile.memory_timeline``): every allocation and free, with the bytes in use after
    it. The step is traced and run once before the profiled call. On a CPU the allocator
    records only with ``TF_CPU_ALLOCATOR_USE_BFC=true``; without it this raises ValueError."""
    params = residual_mlp(blocks, width)
    x = tf.constant(np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32))
    step = tf.function(lambda: gradient_step(params, x, variant), autograph=False)
    step()[0].numpy()
    events = profile.read_trace(lambda: step()[0].numpy(), profile.memory_timeline, logdir)
    if not events:
        raise ValueError("the trace holds no allocator events: on CPU set "
                         "TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow's first op")
    return events


def _backward_start(events) -> int | None:
    """Index of the first allocation by a matmul of the gradient tape (the backward's first)."""
    return next((i for i, e in enumerate(events)
                 if e.op.startswith("gradient_tape/") and "MatMul" in e.op), None)


def figure_memory_timeline(timelines: Mapping[str, Sequence[profile.MemoryEvent]]):
    """One line per variant: the allocator's bytes in use above the level before the step's
    first event, against the allocations and frees in the order they happened
    (``step_memory_timeline``'s events); a dotted line marks each variant's first backward
    matmul."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for i, (name, events) in enumerate(timelines.items()):
        start = events[0].in_use - events[0].change
        color = f"C{i}"
        ax.plot([(e.in_use - start) / 2**20 for e in events], label=name, color=color)
        turn = _backward_start(events)
        if turn is not None:
            ax.axvline(turn, color=color, ls=":", lw=1)
    ax.set_xlabel("allocations and frees, in order (dotted: first backward matmul)")
    ax.set_ylabel("MiB in use above the start")
    ax.set_title("one gradient step, from the allocator's profiler events")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# Bytes per parameter of mixed-precision training with Adam as ZeRO counts them (Rajbhandari et
# al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv:1910.02054,
# section 3.1): 16-bit weights and gradients, and the optimizer's fp32 state (a master copy of
# the weights and Adam's two moments), 16 in all.
MIXED_ADAM_BYTES: dict[str, int] = {
    "weights (bf16/fp16)": 2, "gradients (bf16/fp16)": 2, "master weights (fp32)": 4,
    "Adam m (fp32)": 4, "Adam v (fp32)": 4,
}
# Megatron-LM with bf16 weights accumulates and all-reduces gradients in fp32 (``main_grad``):
# 18 bytes per parameter without a distributed optimizer (Megatron Core developer guide,
# "Distributed Optimizer": "bf16 parameters, fp32 gradients: 18").
MEGATRON_BF16_BYTES: dict[str, int] = {
    "weights (bf16)": 2, "main gradients (fp32)": 4, "master weights (fp32)": 4,
    "Adam m (fp32)": 4, "Adam v (fp32)": 4,
}


def _check_shape(layers, hidden, heads, seq, batch) -> None:
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq),
                        ("batch", batch)):
        checks.positive_int(name, value)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")


def transformer_memory(params: int, layers: int, hidden: int, heads: int, seq: int,
                       batch: int = 1, flash_attention: bool = False,
                       state_bytes: Mapping[str, int] = MIXED_ADAM_BYTES) -> dict[str, float]:
    """Bytes one device holds to train a GPT-style transformer of ``params`` parameters and
    ``layers`` layers (hidden size ``hidden``, ``heads`` attention heads) on ``batch`` sequences
    of ``seq`` tokens, with mixed-precision Adam, no sharding and no recomputation: the model
    states of ``state_bytes`` (bytes per parameter of each part, one entry per part:
    ``MIXED_ADAM_BYTES``, or ``MEGATRON_BF16_BYTES`` for fp32 gradient accumulation), their sum
    ``"model states"``, the ``"activations"`` the layers keep for the backward pass, and the
    ``"total"``.

    Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", arXiv:2205.05198, section 4.1; 16-bit, dropout masks included):
    ``s b h (34 + 5 a s / h)`` bytes; the ``5 a s / h`` part is what attention keeps per head
    of its ``s x s`` matrices: the softmax output (``2 a s^2 b``), the dropout mask
    (``a s^2 b``) and the dropout output (``2 a s^2 b``); the scores before the softmax are not
    kept. FlashAttention keeps none of them (``flash_attention=True`` keeps ``34 s b h``). Not
    counted: the embedding's and the logits' activations, the kernels' workspace, the
    allocator's fragmentation."""
    checks.positive_int("params", params)
    _check_shape(layers, hidden, heads, seq, batch)
    out: dict[str, float] = {part: per * params for part, per in state_bytes.items()}
    out["model states"] = sum(state_bytes.values()) * params
    per_layer = (34 * seq * batch * hidden if flash_attention
                 else transformer_cost.layer_activation_bytes(batch, seq, hidden, heads))
    out["activations"] = layers * per_layer
    out["total"] = out["model states"] + out["activations"]
    return out


def recomputation_plans(layers: int, hidden: int, heads: int, seq: int,
                        batch: int = 1) -> dict[str, tuple[float, float]]:
    """A cost model of activation recomputation for the transformer of ``transformer_memory``:
    plan -> (activation bytes at the backward pass's peak, extra training FLOPs as a fraction of
    a step without recomputation). With ``A = s b h (34 + 5 a s / h)``, one layer's stored
    activations (Korthikanti et al. 2022, section 4.1), and ``2 s b h`` its 16-bit input:

    * ``"keep everything"``: ``L A``, nothing recomputed;
    * ``"selective"`` (recompute attention's core, ``Q K^T``, softmax, dropout and attention over
      ``V``, whose softmax output, dropout mask and dropout output are the ``5 a s^2 b``;
      Korthikanti et al., section 5): ``L 34 s b h`` kept, plus one layer's ``5 a s^2 b`` rebuilt
      at a time; extra work: the two ``s x s`` matmuls, ``4 b s^2 h`` per layer;
    * ``"full, every layer"`` (keep each layer's input, rerun its forward): ``2 s b h L + A``;
      extra work: one forward pass, a third of a training step (``accel.costmodel.transformer``:
      3 passes);
    * ``"sqrt(L) segments"`` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
      arXiv:1604.06174, section 4: keep the input of every k-th layer, ``k = round(sqrt(L))``,
      and rebuild one segment of ``k`` layers at a time): ``2 s b h ceil(L / k) + k A``; extra
      work: one forward pass.

    FLOPs count the matmuls (Narayanan et al. 2021, eq. 3, as ``accel.costmodel.transformer``);
    the memory of the plans that keep less than a layer counts what one layer rebuilds at a time
    (Korthikanti et al. count only what is kept)."""
    _check_shape(layers, hidden, heads, seq, batch)
    s, b, h, n = seq, batch, hidden, layers
    stored = transformer_cost.layer_activation_bytes(b, s, h, heads)
    scores = 5 * heads * s * s * b
    step = transformer_cost.layer_flops(b, s, h, passes=3)
    forward = transformer_cost.layer_flops(b, s, h, passes=1)
    score_matmuls = forward - transformer_cost.layer_flops(b, s, h, passes=1,
                                                           attention_scores=False)
    k = max(1, round(math.sqrt(n)))
    return {
        "keep everything": (n * stored, 0.0),
        "selective": (n * 34 * s * b * h + scores, score_matmuls / step),
        "full, every layer": (2 * s * b * h * n + stored, forward / step),
        "sqrt(L) segments": (2 * s * b * h * math.ceil(n / k) + k * stored, forward / step),
    }


def _sum_and_squares(seed):
    a = tf.random.stateless_uniform((1024, 2048), seed=seed)
    return tf.reduce_sum(tf.square(a)) + tf.reduce_sum(a)


_FRESH_PEAK = """
import base64, json
import tensorflow as tf
from accel.memory.measure import memory_device, peak_during
spec = json.loads({spec!r})
graph = tf.compat.v1.GraphDef.FromString(base64.b64decode(spec["graph"]))
def imported(seed):
    return tf.graph_util.import_graph_def(graph, input_map={{spec["input"]: seed}},
                                          return_elements=[spec["output"]])[0]
step = tf.compat.v1.wrap_function(imported, [tf.TensorSpec([2], tf.int32)])
seed = tf.constant([0, 5])
step(seed)
print(min(peak_during(lambda: step(seed), memory_device())[0] for _ in range(3)))
"""


def _fresh_peak(step, seed) -> int:
    """The peak of ``step(seed)`` (a ``tf.function``) measured in a fresh process, from its
    traced graph: no buffer of this process's other work is held there while it runs."""
    import base64
    import json

    from accel.procs import run_python

    traced = step.get_concrete_function(seed)
    spec = {"graph": base64.b64encode(traced.graph.as_graph_def().SerializeToString()).decode(),
            "input": traced.inputs[0].name, "output": traced.outputs[0].name}
    out = run_python(_FRESH_PEAK.format(spec=json.dumps(spec)),
                     env={"TF_CPU_ALLOCATOR_USE_BFC": "true"}, warm=True)
    return int(out.split()[-1])


def _order(step, seed) -> str:
    """Which of a sum of the 8 MiB tensor and the ``Square`` that reads it the traced graph of
    ``step`` runs first: ``"sum"`` or ``"square"`` when one is an ancestor of the other
    (through data or control edges), ``"either"`` when nothing orders them: the executor
    may then run them in either order, and which it takes varies from run to run;
    ``"unknown"`` when the graph has no such pair."""
    graph = step.get_concrete_function(seed).graph

    def ancestors(op) -> set:
        stack, seen = [op], set()
        while stack:
            cur = stack.pop()
            for up in [t.op for t in cur.inputs] + list(cur.control_inputs):
                if up.name not in seen:
                    seen.add(up.name)
                    stack.append(up)
        return seen

    for square in (op for op in graph.get_operations() if op.type == "Square"):
        a = square.inputs[0]
        sums = [op for op in a.consumers() if op.type == "Sum" and op.inputs[0] is a]
        if any(s.name in ancestors(square) for s in sums):
            return "sum"
        if any(square.name in ancestors(s) for s in sums):
            return "square"
        if sums:
            return "either"
    return "unknown"  # no Square beside a Sum of its input (a ** 2, a * a...): measure only


def check_one_buffer(answer) -> str:
    """04, exercise 1: a function of ``seed`` with the value of ``sum_and_squares`` (an 8 MiB
    tensor ``a``: ``sum(a * a) + sum(a)``) whose measured peak is one 8 MiB buffer. The peak is the
    allocator's (``measure.peak_during``, the smallest of three runs after a warm-up), so the
    check needs ``TF_CPU_ALLOCATOR_USE_BFC=true`` as chapter 04 sets it. The allocator is
    shared by the whole process: a buffer some other work allocates while the step runs adds
    to the peak, never takes from it. So a peak of one buffer is final, and a larger one is
    measured again in a fresh process before the check says "not yet". An element-wise op
    writes into its input's buffer when nothing else will read that input (TensorFlow's buffer
    forwarding): ``tf.square(a)`` can reuse ``a``'s buffer only if the sum of ``a`` has
    already run. So the answer's graph must order them (``_order``): with data
    flow alone, both are ready at once and the order, hence the peak, varies between runs."""
    if answer is None:
        return "exercise 1: not answered yet"
    seed = tf.constant([0, 5])
    want = float(tf.function(_sum_and_squares, autograph=False)(seed))
    step = tf.function(answer)
    got = float(step(seed))
    if not np.isclose(got, want, rtol=1e-3):
        return f"exercise 1: the value changed ({got:.6g}, expected {want:.6g})"
    order = _order(step, seed)
    if order == "either":
        return ("exercise 1: not yet: nothing makes the sum of `a` run before the square, so "
                "the executor may run them in either order (and reuses `a`'s buffer only when "
                "the sum happens to come first)")
    try:
        peak = min(peak_during(lambda: step(seed), memory_device())[0] for _ in range(3))
    except ValueError:
        return "exercise 1: no allocator statistics: set TF_CPU_ALLOCATOR_USE_BFC=true first"
    if round(peak / MIB) > 8:
        peak = min(peak, _fresh_peak(step, seed))
    mib = round(peak / MIB)
    if mib <= 8:
        return f"exercise 1: correct: {mib} MiB, one buffer reused in place"
    return (f"exercise 1: not yet: {mib} MiB; the square still needs a buffer of its own "
            "because `a` is read again after it")


# exercise 2's transformer: GPT-3 6.7B's shape (Brown et al. 2020, Table 2.1) with GPT-2's
# 50,257-token vocabulary, as chapter 04 counts it, at 4096 tokens per sequence
_GPT3_6B7 = {"layers": 32, "hidden": 4096, "heads": 32, "seq": 4096}
_GPT3_6B7_PARAMS = 12 * 32 * 4096**2 + 50257 * 4096


def _largest_fit(plan: str, room: float) -> int:
    """The largest micro-batch whose ``plan`` activations fit in ``room`` bytes (0: none).
    Every plan's activations grow linearly with the micro-batch."""
    one = recomputation_plans(**_GPT3_6B7)[plan][0]
    return max(0, int(room // one))


def check_plan_fits(answer, gpu: str = "NVIDIA B200") -> str:
    """04, exercise 2: ``(plan, micro_batch)`` to train exercise 2's transformer (GPT-3 6.7B's
    shape at 4096 tokens, stored attention scores) on one ``gpu`` of
    ``accel.costmodel.hardware.MEMORY_GB`` without sharding, with mixed-precision Adam (16 bytes
    per parameter): the ``recomputation_plans`` plan with the least extra work among those that
    fit one sequence beside the model states, and the largest micro-batch that fits with it
    (states + the plan's activations at most the GPU's memory, GB = 1e9 bytes)."""
    if answer is None:
        return "exercise 2: not answered yet"
    from accel.costmodel import hardware

    plans = recomputation_plans(**_GPT3_6B7)
    try:
        plan, batch = answer
    except (TypeError, ValueError):
        plan = batch = None
    if plan not in plans or isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        return ("exercise 2: answer with a pair (plan, micro-batch), the plan one of "
                f"{', '.join(map(repr, plans))} and the micro-batch an int >= 1")
    capacity = hardware.MEMORY_GB[gpu].value * 1e9
    room = capacity - sum(MIXED_ADAM_BYTES.values()) * _GPT3_6B7_PARAMS
    fits = {name: _largest_fit(name, room) for name in plans}
    if not any(fits.values()):
        raise ValueError(f"no plan fits one sequence on the {gpu}: pick a larger GPU")
    least = min(plans[name][1] for name in plans if fits[name] >= 1)
    need = plans[plan][0] * batch
    if batch > fits[plan]:
        return (f"exercise 2: not yet: at micro-batch {batch}, {plan!r} keeps "
                f"{need / 1e9:.1f} GB of activations beside {(capacity - room) / 1e9:.1f} GB "
                f"of model states: more than the {capacity / 1e9:.0f} GB of the {gpu}")
    if plans[plan][1] > least:
        return (f"exercise 2: not yet: {plan!r} fits, but a plan with less extra work fits "
                "too; look at the second column")
    if batch < fits[plan]:
        return f"exercise 2: not yet: {plan!r} is right, and it fits a larger micro-batch"
    return (f"exercise 2: correct: {plan!r} at micro-batch {batch}, "
            f"{(capacity - room + need) / 1e9:.1f} of {capacity / 1e9:.0f} GB")


def _kept_line(model) -> tuple[int, int]:
    """``kept(batch) = a + b * batch`` bytes the tape keeps: ``(a, b)`` from two traces."""
    one, two = (tape_kept_bytes(model, tf.zeros((n, *model.inputs[0].shape[1:]))) for n in (1, 2))
    return one - (two - one), two - one


def check_half_pays(answer, mixed, plain) -> str:
    """05, exercise 1: the smallest batch at which the tape of ``mixed`` (a ``mixed_float16``
    model) keeps fewer activation bytes than that of ``plain`` (the same layers in float32)."""
    if answer is None:
        return "exercise 1: not answered yet"
    (a16, b16), (a32, b32) = _kept_line(mixed), _kept_line(plain)
    if b16 >= b32:
        raise ValueError("the mixed model keeps at least as many bytes per example: it never pays")
    right = max(1, (a16 - a32) // (b32 - b16) + 1)  # smallest n: a16 + b16 n < a32 + b32 n
    if answer == right:
        return f"exercise 1: correct: from batch {right} on, half precision keeps fewer bytes"
    if not isinstance(answer, int) or answer < 1:
        return "exercise 1: answer with a batch size (an int >= 1)"
    n = answer
    return (f"exercise 1: not yet: at batch {n} the mixed tape keeps {a16 + b16 * n:,} bytes, "
            f"float32 keeps {a32 + b32 * n:,}; look for the first batch where mixed is smaller")


def check_overflow_steps(answer, gradient: float = 8.0) -> str:
    """05, exercise 2: ``(steps skipped, scale of the first applied step)`` when every step's
    true gradient is ``gradient``, computed in float16 after scaling by Keras 3's
    ``LossScaleOptimizer`` (initial scale 2**15)."""
    if answer is None:
        return "exercise 2: not answered yet"
    import keras

    w = tf.Variable([1.0])
    opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0))
    opt.build([w])
    skipped = 0
    while skipped < 64:
        scale = float(opt.dynamic_scale)
        scaled = tf.cast(tf.constant([gradient]) * scale, tf.float16)  # what float16 holds
        opt.apply([tf.cast(scaled, tf.float32)], [w])
        if float(w[0]) != 1.0:
            break
        skipped += 1
    right = (skipped, scale)
    try:
        mine = (int(answer[0]), float(answer[1]))
    except (TypeError, ValueError, IndexError):
        return "exercise 2: answer with a pair (steps skipped, scale of the first applied step)"
    if mine == right:
        return f"exercise 2: correct: {skipped} steps skipped, then scale {scale:g}"
    return (f"exercise 2: not yet: {mine} is not it; float16's largest number is 65504, and "
            "each skipped step halves the scale")


def check_xla_compilations(answer, compiled) -> str:
    """05, exercise 3: how many XLA programs a ``jit_compile=True`` model compiles when ``fit``
    trains it on 1000 examples at batch size 64 for 2 epochs and ``evaluate`` then runs 250 at
    batch size 100. ``compiled(name)`` counts the programs compiled so far for functions called
    ``name`` (the chapter counts XLA's dump files); the check counts those of Keras's train and
    test step, ``one_step_on_data``, before and after the two calls."""
    if answer is None:
        return "exercise 3: not answered yet"
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < 0:
        return "exercise 3: answer with a number of compilations (an int >= 0)"
    import keras

    before = compiled("one_step_on_data")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, "relu"),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=True)
    xs, ys = np.zeros((1000, 16), "float32"), np.zeros((1000, 1), "float32")
    model.fit(xs, ys, batch_size=64, epochs=2, verbose=0)
    model.evaluate(xs[:250], ys[:250], batch_size=100, verbose=0)
    got = compiled("one_step_on_data") - before
    if answer == got:
        return f"exercise 3: correct: {got} compilations"
    return f"exercise 3: not yet: {answer} is not it; count the batch sizes each loop meets"
