"""Chapter 16 (mixture of experts): the small problem the chapter routes, the alpha-beta model
of the all-to-all on cited links, the small training run that compares load balancing with no
balancing, with the auxiliary loss and with the bias of DeepSeek-V3, and the exercise checks
(each returns "exercise N: not answered yet" for the placeholder the stored notebook holds).

Every time below is a MODEL (arithmetic on figures passed in or cited in
``accel.costmodel.hardware``), never a measurement: between logical devices of one process a
transfer shares the sender's buffer, so a timing there would measure scheduling, not links.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from accel import checks
from accel.costmodel.collectives import all_to_all_time
from accel.costmodel.hardware import bits_per_element, link_bandwidth, peak_flops
from accel.parallel import moe

__all__ = ["problem_inputs", "small_problem", "DEEPSEEK_V3",
           "dispatch_rows", "NVLINK5_BPS", "nvl72_row", "one_hot_cost", "expert_memory",
           "balancing_run", "figure_balance", "CAPACITY_BUDGET",
           "capacity_answer", "capacity_draws", "check_capacity", "IB_QUESTION", "ib_bytes_answer",
           "check_ib_bytes", "check_bias_rate"]


def problem_inputs(tokens: int = 64, width: int = 8, num_experts: int = 4, seed: int = 3):
    """The small problem's tokens ``x`` [tokens, width] and gate [width, E] (float64 arrays),
    drawn first from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(tokens, width)), rng.normal(size=(width, num_experts)), rng


def small_problem(devices: Sequence[str], tokens: int = 64, width: int = 8, hidden: int = 16,
                  num_experts: int = 4, seed: int = 3):
    """``(x, gate, experts)``: ``problem_inputs`` as a tensor and a variable, and ``num_experts``
    ReLU experts ``(w1, w2)`` (variables; expert ``e`` on ``devices[e % len(devices)]``)."""
    x, gate, rng = problem_inputs(tokens, width, num_experts, seed)
    experts = []
    for e in range(num_experts):
        with tf.device(devices[e % len(devices)]):
            experts.append((tf.Variable(rng.normal(size=(width, hidden)) / 3),
                            tf.Variable(rng.normal(size=(hidden, width)) / 3)))
    return tf.constant(x), tf.Variable(gate), experts


# DeepSeek-V3's MoE layer (arXiv:2412.19437; its inference/configs/config_671B.json): width 7168,
# 256 routed experts of hidden 2048 (SwiGLU: three matrices) + 1 shared, top-8, at most 4
# nodes per token; dispatch in FP8 with one scale per 128 values, combine in BF16 (section 3.3)
DEEPSEEK_V3 = {"width": 7168, "expert_hidden": 2048, "routed": 256, "shared": 1, "k": 8,
               "max_nodes": 4}


def dispatch_rows(tokens: int = 4096, gpus_per_node: int = 8, nodes: int = 8,
                  utilization: float = 0.5, nvlink_latency_s: float = 5e-6,
                  ib_latency_s: float = 10e-6) -> list[dict]:
    """One MoE layer of DeepSeek-V3's shape (``DEEPSEEK_V3``) on H100 nodes, ``tokens`` per GPU
    routed uniformly: for three layouts, the bytes one GPU sends on its slowest link in the
    forward pass (dispatch in FP8 with its scales, ``bits_per_element("FP8, 1x128 tiles")``,
    plus combine in BF16) and their modelled time (``all_to_all_time``, once each way),
    beside the experts' forward compute at ``utilization`` of the H100's dense BF16 peak
    (``compute_s``) and of its dense FP8 peak (``compute_fp8_s``: DeepSeek-V3 runs the expert
    GEMMs in FP8, section 3.3.1).

    * EP inside one node: ``gpus_per_node`` GPUs over NVLink 4; a token's copy for an expert on
      another GPU of the node crosses NVLink: ``(g - 1) / g`` of the ``tokens * k`` copies.
    * EP over ``nodes`` nodes, a copy per (token, expert): ``(N g - g) / (N g)`` of the copies
      cross InfiniBand NDR (one 400 Gb/s adapter per GPU, as in a DGX H100).
    * The same, one copy per token and remote node, at most ``max_nodes`` nodes per token
      (DeepSeek-V3's node-limited routing, section 2.1.2; forwarded inside the node over
      NVLink, section 3.2.2): at most ``max_nodes`` copies per token cross InfiniBand.

    Latencies are assumed values. The ratio of all-to-all time to compute does not depend on
    ``tokens`` (both grow with it) beyond the latency terms."""
    tokens = checks.positive_int("tokens", tokens)
    g, nn = checks.positive_int("gpus_per_node", gpus_per_node), checks.positive_int("nodes",
                                                                                       nodes)
    utilization = checks.positive_number("utilization", utilization)
    m = DEEPSEEK_V3
    per_copy = m["width"] * (bits_per_element("FP8, 1x128 tiles") / 8 + 2)  # dispatch + combine
    copies = tokens * m["k"]
    flops = copies * 6 * m["width"] * m["expert_hidden"]  # three matrices, 2 FLOPs per MAC
    compute = flops / (utilization * peak_flops("NVIDIA H100 SXM", "bf16"))
    compute_fp8 = flops / (utilization * peak_flops("NVIDIA H100 SXM", "fp8"))
    nvlink, ib = link_bandwidth("NVLink 4 (H100, per GPU)"), link_bandwidth(
        "InfiniBand NDR (400 Gb/s)")
    cases = [
        (f"EP={g}, one node", "NVLink 4", copies * (g - 1) / g, g, nvlink_latency_s, nvlink),
        (f"EP={nn * g}, {nn} nodes, a copy per expert", "IB NDR",
         copies * (nn * g - g) / (nn * g), nn * g - g + 1, ib_latency_s, ib),
        (f"EP={nn * g}, {nn} nodes, a copy per node, <= {m['max_nodes']} nodes", "IB NDR",
         tokens * min(m["max_nodes"], nn - 1), nn, ib_latency_s, ib),
    ]
    rows = []
    for name, link, sent_copies, n, alpha, bw in cases:
        nbytes = sent_copies * per_copy
        half = sent_copies * m["width"]  # elements each way
        t = (all_to_all_time(half * bits_per_element("FP8, 1x128 tiles") / 8, n, alpha, bw)
             + all_to_all_time(half * 2, n, alpha, bw))
        rows.append({"layout": name, "link": link, "bytes": nbytes, "time_s": t,
                     "compute_s": compute, "compute_fp8_s": compute_fp8})
    return rows


# NVIDIA GB200 NVL72 data sheet: 72 Blackwell GPUs in one NVLink domain, fifth-generation
# NVLink at 1.8 TB/s per GPU (both directions together): 900 GB/s each way
NVLINK5_BPS = 900e9


def nvl72_row(tokens: int = 4096, gpus: int = 64, utilization: float = 0.5,
              latency_s: float = 5e-6) -> dict:
    """``dispatch_rows``'s layer with EP = ``gpus`` inside one GB200 NVL72 NVLink domain: every
    copy for another GPU, ``(gpus - 1) / gpus`` of them, crosses NVLink 5 (``NVLINK5_BPS``); the
    compute at ``utilization`` of the B200's dense BF16 and FP8 peaks
    (``accel.costmodel.hardware``; the GB200's GPU is a little faster). Same keys as a row of
    ``dispatch_rows``; the latency is an assumed value."""
    tokens, gpus = checks.positive_int("tokens", tokens), checks.positive_int("gpus", gpus)
    if gpus > 72:
        raise ValueError(f"gpus must be at most 72 (one NVL72 domain), got {gpus}")
    utilization = checks.positive_number("utilization", utilization)
    m, fp8 = DEEPSEEK_V3, bits_per_element("FP8, 1x128 tiles") / 8
    copies = tokens * m["k"] * (gpus - 1) / gpus
    flops = tokens * m["k"] * 6 * m["width"] * m["expert_hidden"]
    t = (all_to_all_time(copies * m["width"] * fp8, gpus, latency_s, NVLINK5_BPS)
         + all_to_all_time(copies * m["width"] * 2, gpus, latency_s, NVLINK5_BPS))
    return {"layout": f"EP={gpus}, one NVL72 domain (B200 compute)", "link": "NVLink 5",
            "bytes": copies * m["width"] * (fp8 + 2), "time_s": t,
            "compute_s": flops / (utilization * peak_flops("NVIDIA B200", "bf16")),
            "compute_fp8_s": flops / (utilization * peak_flops("NVIDIA B200", "fp8"))}


def one_hot_cost(tokens: int, k: int, capacity_factor: float, width: int,
                 expert_hidden: int, matrices: int = 3) -> dict:
    """The one-hot dispatch of a capacity layer for one group of ``tokens``: its ``[tokens, E,
    C]`` mask has ``tokens * E * C = capacity_factor * k * tokens**2`` entries whatever E, and
    the dispatch and combine einsums take ``2 * 2 * tokens * E * C * width`` FLOPs, against
    ``2 * matrices * width * expert_hidden`` per slot for the experts: a ratio of
    ``2 * tokens / (matrices * expert_hidden)``, which grows with the group."""
    tokens, k = checks.positive_int("tokens", tokens), checks.positive_int("k", k)
    capacity_factor = checks.positive_number("capacity_factor", capacity_factor)
    width = checks.positive_int("width", width)
    expert_hidden = checks.positive_int("expert_hidden", expert_hidden)
    slots = capacity_factor * k * tokens  # E * C
    einsum = 4 * tokens * slots * width
    experts = slots * 2 * matrices * width * expert_hidden
    return {"mask_entries": tokens * slots, "einsum_flops": einsum, "expert_flops": experts,
            "ratio": einsum / experts}


def expert_memory(ep: int, layers: int = 4, shard_over: int = 1) -> float:
    """Bytes of routed-expert state on one GPU for DeepSeek-V3's experts (``DEEPSEEK_V3``; three
    7168 x 2048 matrices each) at expert parallelism ``ep`` with ``layers`` MoE layers on the
    GPU's pipeline stage: BF16 weights and gradients (4 bytes per parameter) plus an FP32 master
    copy and Adam's two FP32 moments (12 bytes), the 12 sharded over ``shard_over`` copies (a
    distributed optimizer, ZeRO-1, over the expert-data-parallel group)."""
    ep, layers = checks.positive_int("ep", ep), checks.positive_int("layers", layers)
    shard_over = checks.positive_int("shard_over", shard_over)
    m = DEEPSEEK_V3
    if m["routed"] % ep:
        raise ValueError(f"ep must divide {m['routed']} experts, got {ep}")
    params = layers * m["routed"] // ep * 3 * m["width"] * m["expert_hidden"]
    return params * (4 + 12 / shard_over)


def balancing_run(method: str, steps: int = 50, tokens: int = 256, width: int = 8,
                  num_experts: int = 8, k: int = 2, hidden: int = 16, aux_weight: float = 1.0,
                  rate: float = 0.01, lr: float = 0.05, skew: float = 2.0,
                  seed: int = 0) -> dict:
    """Train a small dropless MoE layer (``moe.dropless_layer``, residual ``x + moe(x)``,
    target ``tanh(x A)``, SGD, float64) for ``steps`` steps on fresh batches chosen by step
    number, its gate started with every token drawn towards expert 0 (feature 0 is 1 for every
    token, and ``gate[0, 0]`` gets ``+skew``). ``method``: ``"none"`` (task loss only),
    ``"aux"`` (plus ``aux_weight`` times Switch Transformer's loss on the first choices, as
    GShard counts them) or ``"bias"`` (DeepSeek-V3's bias on the selection, moved by ``rate``
    after each step by ``moe.update_bias``). Returns ``{"load": [steps, E] choices per expert,
    "loss": [steps] task loss}``; deterministic."""
    checks.one_of("method", method, ("none", "aux", "bias"))
    steps = checks.positive_int("steps", steps)
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(width, width))
    xs = rng.normal(size=(steps, tokens, width))
    xs[:, :, 0] = 1.0
    g0 = rng.normal(size=(width, num_experts)) * 0.5
    g0[0, 0] += skew
    gate = tf.Variable(g0)
    experts = [(tf.Variable(rng.normal(size=(width, hidden)) / np.sqrt(width)),
                tf.Variable(rng.normal(size=(hidden, width)) / np.sqrt(hidden)))
               for _ in range(num_experts)]
    weights = [gate] + [w for pair in experts for w in pair]
    sgd = keras.optimizers.SGD(lr)
    bias = np.zeros(num_experts)
    loads, losses = [], []
    for s in range(steps):
        x, y = tf.constant(xs[s]), tf.constant(np.tanh(xs[s] @ a))
        with tf.GradientTape() as tape:
            out, expert, logits = moe.dropless_layer(x, gate, experts, k,
                                                     bias if method == "bias" else None)
            loss = tf.reduce_mean(tf.square(x + out - y))
            total = loss
            if method == "aux":
                probs = tf.nn.softmax(logits)
                total += aux_weight * moe.load_balancing_loss(probs, expert[:, 0], num_experts)
        sgd.apply_gradients(zip(tape.gradient(total, weights), weights, strict=True))
        load = moe.expert_load(expert.numpy(), num_experts)
        if method == "bias":
            bias = moe.update_bias(bias, load, rate)
        loads.append(load)
        losses.append(float(loss))
    return {"load": np.array(loads), "loss": np.array(losses)}


def figure_balance(runs: dict):
    """The busiest expert's load over the mean, step by step, one line per run."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, run in runs.items():
        load = run["load"]
        ax.plot(load.max(1) / load.mean(1), label=name)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("training step")
    ax.set_ylabel("busiest expert / mean load")
    ax.legend()
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- exercises
CAPACITY_BUDGET = {"k": 2, "groups": 1, "max_dropped_share": 0.05, "step": 0.05}


def _dropped(factor: float, groups: int | None = None, seed: int = 3) -> tuple[int, int]:
    """Choices dropped (and made) by top-2 routing of the small problem (``problem_inputs(seed=
    seed)``) in ``groups`` groups (default ``CAPACITY_BUDGET["groups"]``: one group of all 64)."""
    x, gate, _ = problem_inputs(seed=seed)
    b = CAPACITY_BUDGET
    dropped = made = 0
    for xg in np.split(x, b["groups"] if groups is None else groups):
        logits = xg @ gate
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        cap = moe.capacity_of(len(xg), gate.shape[1], b["k"], factor)
        dropped += moe.route(probs, b["k"], cap).dropped
        made += len(xg) * b["k"]
    return dropped, made


def capacity_answer(groups: int | None = None, seed: int = 3) -> float:
    """The smallest capacity factor on the grid of ``CAPACITY_BUDGET["step"]`` that keeps the
    dropped choices within the budget (``groups`` and ``seed`` as in ``_dropped``)."""
    b = CAPACITY_BUDGET
    for i in range(1, 200):
        f = round(i * b["step"], 10)
        dropped, made = _dropped(f, groups, seed)
        if dropped <= b["max_dropped_share"] * made:
            return f
    raise RuntimeError("no capacity factor below 10 meets the budget")


def capacity_draws(seeds: Sequence[int] = range(8)) -> list[tuple[float, float]]:
    """For other draws of the small problem (``problem_inputs(seed=s)``): the smallest factor
    within the budget with one group of 64 tokens and with 4 groups of 16."""
    return [(capacity_answer(1, s), capacity_answer(4, s)) for s in seeds]


def check_capacity(answer) -> str:
    """Exercise 1: the smallest capacity factor (a multiple of 0.05) that drops at most 5% of
    the small problem's top-2 choices, its 64 tokens routed as one group."""
    if answer is None:
        return "exercise 1: not answered yet"
    if isinstance(answer, bool) or not isinstance(answer, int | float) or answer <= 0:
        return f"exercise 1: not quite: give a capacity factor > 0, got {answer!r}"
    dropped, made = _dropped(float(answer))
    best = capacity_answer()
    if dropped > CAPACITY_BUDGET["max_dropped_share"] * made:
        return (f"exercise 1: not yet: factor {answer} drops {dropped} of {made} choices, over "
                "the 5% budget")
    if float(answer) > best + 1e-9:
        return (f"exercise 1: not yet: {answer} meets the budget ({dropped} of {made} dropped) "
                "but a smaller factor does too; every slot beyond it is padding that costs "
                "compute and all-to-all bytes")
    draws = capacity_draws()
    smaller = sum(one < four - 1e-9 for one, four in draws)
    larger = sum(one > four + 1e-9 for one, four in draws)
    return (f"exercise 1: correct: {answer} drops {dropped} of {made} choices; the slots it "
            "reserves beyond the tokens routed are the price of a fixed shape. On "
            f"{len(draws)} other draws of the problem one group needs a smaller factor than 4 "
            f"groups {smaller} times, a larger one {larger} times (one group of 64 evens out "
            "more of the routing's noise)")


IB_QUESTION = {"gpus": 16, "gpus_per_node": 4, "experts": 64, "k": 2, "tokens": 1280,
               "width": 4096, "expert_hidden": 1024, "matrices": 3, "bytes_per_value": 2}


def ib_bytes_per_gpu() -> tuple[int, int]:
    """InfiniBand bytes one GPU sends, uniform routing, BF16: (layout A, EP=16 over the 4 nodes:
    dispatch and combine in the forward and again in the backward pass, per micro-batch;
    layout B, EP=4 inside each node times DP=4 across the nodes: the ring all-reduce of its 16
    experts' gradients over the 4 copies, ``2 (d - 1) / d`` of them, once per step)."""
    q = IB_QUESTION
    remote = (q["gpus"] - q["gpus_per_node"]) / q["gpus"]
    copy = q["width"] * q["bytes_per_value"]
    a = int(4 * q["tokens"] * q["k"] * remote * copy)
    dp = q["gpus"] // q["gpus_per_node"]
    held = q["experts"] // q["gpus_per_node"]  # experts on one GPU of an EP=4 group
    grads = held * q["matrices"] * q["width"] * q["expert_hidden"] * q["bytes_per_value"]
    return a, int(2 * (dp - 1) / dp * grads)


def ib_bytes_answer() -> int:
    """The smallest number of micro-batches per step for which layout A sends more bytes over
    InfiniBand per GPU than layout B."""
    a, b = ib_bytes_per_gpu()
    return b // a + 1


def check_ib_bytes(answer) -> str:
    """Exercise 2: the smallest number of micro-batches per optimizer step from which EP=16
    (all-to-all over InfiniBand every micro-batch) sends more InfiniBand bytes per GPU than
    EP=4 x DP=4 (an expert-gradient all-reduce across the nodes once per step)."""
    if answer is None:
        return "exercise 2: not answered yet"
    if isinstance(answer, bool) or not isinstance(answer, int) or answer < 1:
        return f"exercise 2: not quite: give a whole number of micro-batches >= 1, got {answer!r}"
    a, b = ib_bytes_per_gpu()
    want = ib_bytes_answer()
    if answer == want:
        return (f"exercise 2: correct: A sends {a / 1e6:.1f} MB per micro-batch, B "
                f"{b / 1e6:.1f} MB per step; B also holds 4 copies of every expert, and its "
                "all-reduce can overlap the backward pass while A's all-to-all sits between "
                "the layers")
    return (f"exercise 2: not yet: count A's four all-to-alls per micro-batch (12 of 16 GPUs "
            f"are in other nodes) and B's ring all-reduce of the gradients of the 16 experts "
            f"one GPU holds; {answer} is too {'few' if answer < want else 'many'}")


def check_bias_rate(answer, runs: dict | None = None) -> str:
    """Exercise 3: ``(slow, fast)``, each ``"better"`` or ``"worse"``: is the balance over the
    last 10 steps better or worse than with rate 0.01 when the rate is 0.001 (DeepSeek-V3's)
    and when it is 0.1? ``runs`` (optional) maps a rate to its ``balancing_run``."""
    if answer is None:
        return "exercise 3: not answered yet"
    if not isinstance(answer, tuple | list) or len(answer) != 2 or \
            any(a not in ("better", "worse") for a in answer):
        return "exercise 3: not quite: give a pair, each 'better' or 'worse'"
    runs = dict(runs or {})
    score = {}
    for rate in (0.01, 0.001, 0.1):
        if rate not in runs:
            runs[rate] = balancing_run("bias", rate=rate)
        load = runs[rate]["load"][-10:]
        score[rate] = float(np.mean(load.max(1) / load.mean(1)))
    want = tuple("better" if score[r] < score[0.01] else "worse" for r in (0.001, 0.1))
    if tuple(answer) == want:
        return ("exercise 3: correct: too small a rate has not caught up with the skew yet; too "
                "large a one overshoots, and the loads swing from step to step")
    return (f"exercise 3: not yet: busiest/mean over the last 10 steps is "
            f"{score[0.001]:.2f} (0.001), {score[0.01]:.2f} (0.01), {score[0.1]:.2f} (0.1)")
