"""Chapter 15's experiments: ZeRO stages and offload ready to time, the bytes they hold and send
next to the paper's formulas, the ``zero`` benchmark, a figure and the exercise checks.

* ``mlp_layer_fns(params)``: the MLP of ``accel.models.mlp_apply`` as ``ZeroStep``'s layers;
* ``make_steps(device_names, n, sizes, batch)``: ``{"dp", "zero1", "zero2", "zero3",
  "offload"}`` -> (the step object, its inputs), same model, data and Adam;
* ``held_table`` / ``sent_table``: per stage, the bytes one device holds / sends, counted and by
  the formula;
* ``bench(device_names, quick=False)``: ``python -m accel bench zero``;
* ``figure_zero_memory()``: the paper's example (7.5B parameters, N = 64) as bars;
* ``copy_of`` / ``same_weights``: a Keras model's twin, and the check that two trained twins
  hold the same weights; ``variables_on``: one variable per device (a shard each);
* ``gathered_bytes`` / ``gather_waits`` / ``stage3_timeline``: what stage 3 gathers per layer
  on a device and what each gather waits for, read from the traced graph, and one step's
  gathers and layers on a device's lanes, read from a profiler trace;
* ``keras_sent_bytes``: the bytes each device sends in one step of a Keras form (ZeRO 1-2 with
  accumulation, offload), counted in the graph that ran;
* ``OFFLOAD_SETUPS``, ``offload_with_host_adam`` / ``host_adam_break_even_tokens``: the
  ZeRO-Offload cost model (``accel.costmodel.zero.zero_offload_step``) on two hosts;
  ``OFFLOAD_HOSTS`` (DGX A100, DGX H100, GH200) and ``GATHER_LINKS`` (stage 3's all-gather on
  NVLink and InfiniBand), the chapter's cost-model inputs with their data sheets;
* the exercises' checks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import collectives, profile, timing
from accel.costmodel import zero as cost
from accel.models import mlp_apply, mlp_init
from accel.parallel.layers import dense, linear
from accel.parallel.offload import OffloadStep
from accel.parallel.zero import ZeroStep
from accel.training import squared_error

__all__ = ["SIZES", "NAMES", "mlp_layer_fns", "make_steps", "held_table", "sent_table",
           "time_steps", "bench", "figure_zero_memory", "copy_of", "same_weights", "variables_on",
           "gathered_bytes", "gather_waits", "stage3_timeline", "keras_sent_bytes",
           "HOST_ADAM_BYTES_PER_PARAM", "HOST_DRAM_SOURCE", "OFFLOAD_SETUPS",
           "offload_with_host_adam", "host_adam_break_even_tokens",
           "check_accumulation_ratios", "check_offload_bound", "check_token_weight",
           "OFFLOAD_HOSTS", "GATHER_LINKS", "check_prefetch_layers", "check_stage_for_budget"]

# 64*256+256 = 16640 and 256*64+64 = 16448 parameters per layer: both divide by 2 and 4
SIZES = [64, 256, 64]
NAMES = ("dp", "zero1", "zero2", "zero3", "offload")


def mlp_layer_fns(params) -> list:
    """``ZeroStep``'s ``layer_fns`` for the MLP ``params`` (``[w0, b0, ...]``): ReLU layers and
    a linear last one, the layers of ``accel.models.mlp_apply``."""
    return [dense] * (len(params) // 2 - 1) + [linear]


def make_steps(device_names: Sequence[str], n: int = 2, sizes: Sequence[int] = SIZES,
               batch: int = 64, seed: int = 0) -> dict[str, tuple]:
    """Each way of training, on the first ``n`` devices (offload: Adam on the last device, left
    out when there is no device left), with the same initial weights and data: name -> (step
    object, xs, ys)."""
    devs = list(device_names[:n])
    params = mlp_init(list(sizes), seed=seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.normal(size=(batch, sizes[0])).astype(np.float32)
    y = rng.normal(size=(batch, sizes[-1])).astype(np.float32)
    xs = collectives.place(list(np.split(x, n)), devs)
    ys = collectives.place(list(np.split(y, n)), devs)
    out = {name: (ZeroStep(params, devs, stage, squared_error,
                           layer_fns=mlp_layer_fns(params)), xs, ys)
           for stage, name in enumerate(NAMES[:4])}
    if n < len(device_names):
        out["offload"] = (OffloadStep(params, devs, device_names[-1], squared_error,
                                      model_fn=mlp_apply), xs, ys)
    return out


def held_table(steps: dict, precision: str = "fp32") -> list[tuple]:
    """Per ZeRO stage: (name, counted bytes on device 0 as weights/grads/optimizer/total, the
    formula's total, the formula as text)."""
    rows = []
    for stage, name in enumerate(NAMES[:4]):
        step = steps[name][0]
        held = step.held_bytes()[step.devices[0]]
        want = cost.zero_bytes_per_device(step.padded_params, step.n, stage, precision)
        rows.append((name, held, want["total"], cost.zero_formula(stage, precision)))
    return rows


def sent_table(steps: dict) -> list[tuple]:
    """Per ZeRO stage: (name, bytes each device sent in one step, counted (min, max), formula)."""
    rows = []
    for stage, name in enumerate(NAMES[:4]):
        step, xs, ys = steps[name]
        sent = collectives.sent_bytes(step.step, xs, ys)
        rows.append((name, min(sent.values()), max(sent.values()),
                     cost.zero_comm_bytes(step.padded_params, step.n, stage, "fp32")))
    return rows


def time_steps(steps: dict, rounds: int = 3, repeat: int = 5) -> dict[str, float]:
    """Median seconds of one step of each, timed in interleaved rounds."""
    fns = {k: (lambda s=s, x=x, y=y: [v.numpy() for v in s.step(x, y)])
           for k, (s, x, y) in steps.items()}
    return timing.interleaved_medians(fns, rounds, repeat)


def bench(device_names: Sequence[str], quick: bool = False) -> dict:
    """Step time of ZeRO 1-3 and offload vs plain data parallelism on the same 2 devices
    (ratios from one run) and bytes sent per step vs the formulas (n = 2 and 4)."""
    sizes, batch = ([8, 16, 8], 8) if quick else ([256, 1024, 256], 256)
    rounds, repeat = (1, 1) if quick else (3, 5)
    steps = make_steps(device_names, 2, sizes, batch)
    t = time_steps(steps, rounds, repeat)
    out = {f"{k}/dp": v / t["dp"] for k, v in t.items()}
    lines = ["median Adam step time on 2 devices (offload: Adam on a third); ratios against "
             "plain data parallelism (dp) of the same run",
             timing.format_ratios(t, "dp")]
    for n in (2,) if quick else (2, 4):
        for name, low, high, want in sent_table(make_steps(device_names, n, sizes, batch)):
            out[f"{name}_bytes_{n}"] = high
            same = low == high == want
            lines.append(f"n={n} {name:6} bytes sent per device per step: counted {low}..{high}"
                         f", formula {want:.0f} ({'equal' if same else 'DIFFERENT'})")
    lines.append(timing.ceiling_line() + "; virtual CPUs share these cores")
    print("\n".join(lines))
    return out


def figure_zero_memory(params: int = 7_500_000_000, n: int = 64):
    """Bytes per device of model states for ZeRO stages 0-3, mixed precision (the paper's
    figure 1 example), split into weights, gradients and optimizer state."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = ["DP (stage 0)", "stage 1", "stage 2", "stage 3"]
    bottom = np.zeros(4)
    for part, color in (("weights", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868")):
        vals = np.array([cost.zero_bytes_per_device(params, n, s)[part] / 1e9 for s in range(4)])
        ax.bar(labels, vals, bottom=bottom, label=part, color=color)
        bottom += vals
    for i, v in enumerate(bottom):
        ax.text(i, v, f"{v:.1f} GB", ha="center", va="bottom")
    ax.set_ylabel("GB per device")
    ax.set_title(f"ZeRO, mixed-precision Adam: {params / 1e9:g}B parameters on N = {n} "
                 "(formulas of arXiv:1910.02054)", fontsize=9)
    ax.legend()
    return fig


def copy_of(model):
    """A Keras model's twin: same architecture, same weights (``keras.models.clone_model``)."""
    import keras

    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def same_weights(model, ref, rtol: float = 1e-12) -> bool:
    """Whether ``model``'s weights equal ``ref``'s within ``rtol`` (and ``rtol`` times the
    largest reference weight, absolute)."""
    want = ref.get_weights()
    scale = max(float(np.abs(w).max()) for w in want)
    return all(np.allclose(a, b, rtol=rtol, atol=rtol * scale)
               for a, b in zip(model.get_weights(), want, strict=True))


def variables_on(parts: Sequence, devices: Sequence[str]) -> list:
    """One ``tf.Variable`` per device: ``parts[i]`` (an array or tensor) on ``devices[i]``."""
    return collectives.place(list(parts), devices, make=tf.Variable)


# -- stage 3: what a device gathers while it runs, and when ------------------------------------

def gathered_bytes(step, xs, ys, device: int = 0) -> dict[int, int]:
    """Layer -> bytes of the full weights that ``ZeroStep`` stage 3 gathers for it on device
    ``device`` in the forward pass: the outputs of the ``fwd_gather_<layer>`` ops placed on
    that device in the traced graph of ``step.step(xs, ys)`` (the same for the backward's
    gather)."""
    if getattr(step, "stage", None) != 3:
        raise ValueError("step must be a ZeroStep of stage 3 (only stage 3 gathers layers)")
    where = collectives.check_devices(step.devices)[device]
    graph = step.step.get_concrete_function(xs, ys).graph
    out: dict[int, int] = {}
    for op in graph.get_operations():
        hit = re.match(r"fwd_gather_(\d+)/", op.name)
        if hit and op.type == "ConcatV2" and op.device == where:
            t = op.outputs[0]
            out[int(hit[1])] = t.shape.num_elements() * t.dtype.size
    return dict(sorted(out.items()))


def gather_waits(step, xs, ys) -> dict[str, list[str]]:
    """What each gather of ``ZeroStep`` stage 3 waits for, read from the traced graph of
    ``step.step(xs, ys)``: gather scope (``fwd_gather_<layer>``, ``bwd_gather_<layer>``) -> the
    scopes of the ops its control dependencies name (the layers whose output it waits for), in
    the run order (forward first, then the backward's last layer first). Empty without
    ``prefetch``."""
    if getattr(step, "stage", None) != 3:
        raise ValueError("step must be a ZeroStep of stage 3 (only stage 3 gathers layers)")
    graph = step.step.get_concrete_function(xs, ys).graph
    waits: dict[str, set[str]] = {}
    for op in graph.get_operations():
        scope = op.name.split("/")[0]
        if re.fullmatch(r"(fwd|bwd)_gather_\d+", scope):
            for c in op.control_inputs:
                waits.setdefault(scope, set()).add(
                    c.name.removeprefix("gradient_tape/").split("/")[0])

    def order(scope):
        way, layer = scope.split("_gather_")
        return (way == "bwd", -int(layer) if way == "bwd" else int(layer))

    return {k: sorted(waits[k]) for k in sorted(waits, key=order)}


_STAGE3_OP = re.compile(r"(?:gradient_tape/)?(fwd|bwd)_(gather|layer)_(\d+)/")


def stage3_timeline(step, xs, ys, logdir: str | None = None, device: int = 0) -> dict:
    """One step of ``ZeroStep`` stage 3 run under TensorFlow's profiler and read back
    (``accel.profile.read_trace``, kept under ``logdir`` if given; ``op_runs``: every op on
    one clock), for device ``device``: ``intervals``,
    ``(lane, start, end, label)`` for ``accel.viz.timeline`` (lane ``"all-gather"``: the
    gathers' concatenations, ``"layer"``: the layers' matmuls; labels ``f<layer>`` forward,
    ``b<layer>`` backward) in ms from the first of them, and ``early``: how many gathers
    started before the previous layer's forward matmul ended on that device, out of
    ``gathers``, the forward's gathers that have a previous layer (a prefetch at work)."""
    where = collectives.check_devices(step.devices)[device]
    graph = step.step.get_concrete_function(xs, ys).graph
    placed = {op.name: op.device for op in graph.get_operations()}
    runs = profile.read_trace(lambda: [v.numpy() for v in step.step(xs, ys)], profile.op_runs,
                              logdir)
    spans: dict[tuple, list] = {}
    for r in runs:
        hit = _STAGE3_OP.match(r.name)
        if not hit or placed.get(r.name) != where:
            continue
        kind = "all-gather" if hit[2] == "gather" else "layer"
        if (kind == "all-gather") != (r.type == "ConcatV2") or (
                kind == "layer" and r.type != "MatMul"):
            continue
        spans.setdefault((kind, hit[1], int(hit[3])), []).append((r.start, r.end))
    if not spans:
        raise ValueError("the trace holds no stage-3 gather or layer of that device")
    t0 = min(s for v in spans.values() for s, _ in v)
    intervals = [(kind, s - t0, e - t0, f"{way[0]}{layer}")
                 for (kind, way, layer), v in spans.items() for s, e in v]
    intervals.sort(key=lambda i: (i[0] != "all-gather", i[1]))
    early = 0
    for layer in range(1, len(step.shapes)):  # the forward pass: layer - 1 runs, then layer
        gather = spans.get(("all-gather", "fwd", layer))
        work = spans.get(("layer", "fwd", layer - 1))
        if gather and work and min(s for s, _ in gather) < max(e for _, e in work):
            early += 1
    return {"intervals": intervals, "early": early, "gathers": len(step.shapes) - 1}


def keras_sent_bytes(form, x, y) -> dict[str, int]:
    """Bytes each device sends in one training step of the Keras ``form`` (``Zero``,
    ``Offload``) on the batch ``x, y``, counted from the ``_Send`` nodes of the graph that ran
    (``accel.collectives.sent_bytes``): the form's micro-steps and its update, as its step runs
    them, without the step's loss (a scalar per micro-batch summed on ``devices[0]``). Each
    device's micro-batches are placed on it first, so what is counted is the training's own
    traffic, not the batch's distribution. The step runs once: use a form made for counting."""
    parts, k, n = form.batch_parts(), form.accumulation_steps, form.n
    placed = []
    for a in [*np.split(np.asarray(x), parts), *np.split(np.asarray(y), parts)]:
        with tf.device(form.devices[len(placed) % parts // k]):  # part p: device p // k
            placed.append(tf.constant(a))

    def step(*args):  # KerasReplicas' step: k micro-steps, then one update
        for j in range(k):
            form._micro_step([args[i * k + j] for i in range(n)],  # noqa: SLF001
                             [args[parts + i * k + j] for i in range(n)], 1.0 / (n * k))
        form._apply()  # noqa: SLF001
        return []

    return collectives.sent_bytes(step, *placed)


# -- ZeRO-Offload's cost model on two hosts ---------------------------------------------------

HOST_ADAM_BYTES_PER_PARAM = cost.HOST_ADAM_BYTES_PER_PARAM
HOST_DRAM_SOURCE = ("peak DRAM bandwidth = channels x transfers/s x 8 bytes: AMD EPYC 7002 "
                    "(Rome, e.g. the 7742) has 8 channels of DDR4-3200 per socket, 204.8 GB/s "
                    "(AMD's EPYC 7002 specifications); NVIDIA's DGX A100 pairs 2 EPYC 7742 with "
                    "8 A100 GPUs (DGX A100 datasheet): 409.6 / 8 = 51.2 GB/s per GPU's "
                    "process. Peaks: STREAM reaches less")
# label -> (data-parallel GPUs n, the DRAM bandwidth each process's Adam gets, bytes/s)
OFFLOAD_SETUPS = {"1 A100, a whole EPYC 7742 socket": (1, 204.8e9),
                  "a DGX A100: 8 A100 sharing 2 sockets": (8, 51.2e9)}


# Hosts of 8 data-parallel GPUs for ZeRO-Offload's cost model, label -> (device, host link (a
# name of accel.costmodel.hardware.LINKS or bytes/s one way), GPUs per host uplink, the DRAM
# bandwidth each GPU's process gets (bytes/s)). Peaks, from data sheets:
# * DGX A100: 2 EPYC 7742 (8 channels DDR4-3200, 204.8 GB/s a socket; AMD EPYC 7002
#   specifications) for 8 A100 (NVIDIA DGX A100 data sheet), behind four PCIe 4.0 switches:
#   two GPUs share each switch's uplink to the CPU (NVIDIA developer blog, "Defining AI
#   Innovation with DGX A100", system architecture);
# * DGX H100: 2 Xeon Platinum 8480C (NVIDIA DGX H100 data sheet), 8 channels DDR5-4800 a
#   socket (Intel's product specifications): 2 x 307.2 / 8 = 76.8 GB/s per GPU; each GPU's
#   own PCIe 5.0 x16 assumed;
# * GH200: each H100 with its own Grace CPU over NVLink-C2C, 900 GB/s both directions (450
#   one way) and LPDDR5X up to 512 GB/s (NVIDIA GH200 Grace Hopper Superchip data sheet).
OFFLOAD_HOSTS = {"DGX A100 (PCIe 4.0, DDR4)": ("NVIDIA A100", "PCIe 4.0 x16", 2, 51.2e9),
                 "DGX H100 (PCIe 5.0, DDR5)": ("NVIDIA H100 SXM", "PCIe 5.0 x16", 1, 76.8e9),
                 "8 GH200 (NVLink-C2C, LPDDR5X)": ("NVIDIA H100 SXM", 450e9, 1, 512e9)}
# ZeRO 3's all-gather per GPU, label -> (device, link (name or bytes/s one way), n). HGX B200:
# NVLink 5, 1.8 TB/s per GPU both directions (NVIDIA HGX B200 specifications); between nodes
# one 400 Gb/s NDR adapter per GPU (ConnectX-7 on DGX H100 and DGX B200 data sheets).
GATHER_LINKS = {"8 H100, NVLink 4": ("NVIDIA H100 SXM", "NVLink 4 (H100, per GPU)", 8),
                "64 H100 over InfiniBand NDR": ("NVIDIA H100 SXM", "InfiniBand NDR (400 Gb/s)", 64),
                "8 B200, NVLink 5": ("NVIDIA B200", 900e9, 8),
                "64 B200 over InfiniBand NDR": ("NVIDIA B200", "InfiniBand NDR (400 Gb/s)", 64)}


def offload_with_host_adam(params: int, tokens: int, device: str, link: str,
                           host_bandwidth: float, precision: str = "bf16",
                           utilization: float = 0.5, n: int = 1) -> dict:
    """``accel.costmodel.zero.zero_offload_step``: each of ``n`` GPUs, its process's Adam
    over ``params / n`` at ``host_bandwidth``."""
    return cost.zero_offload_step(params, tokens, device, link, host_bandwidth, n, precision,
                                  utilization)


def host_adam_break_even_tokens(device: str, host_bandwidth: float, precision: str = "bf16",
                                utilization: float = 0.5, n: int = 1) -> float:
    """``accel.costmodel.zero.host_adam_break_even_tokens``."""
    return cost.host_adam_break_even_tokens(device, host_bandwidth, n, precision, utilization)


# -- the exercises' checks ------------------------------------------------------------------

def check_accumulation_ratios(answer) -> str:
    """Exercise 1: bytes one device sends per step with 4 micro-batches over those with 1,
    N = 8, for ZeRO stage 2 and stage 3: a pair (within 1%)."""
    if answer is None:
        return "not yet: set answer to a pair (stage 2 ratio, stage 3 ratio)"
    try:
        two, three = (float(a) for a in answer)
    except (TypeError, ValueError):
        return f"not quite: give two numbers, got {answer!r}"
    right = [cost.zero_comm_bytes_accumulated(10**9, 8, s, 4) / cost.zero_comm_bytes(10**9, 8, s)
             for s in (2, 3)]
    if all(abs(a - r) <= 0.01 * r for a, r in zip((two, three), right, strict=True)):
        return (f"right: stage 2 reduce-scatters each micro-batch but gathers once, (4 + 1) / "
                f"(1 + 1) = {right[0]:g}; stage 3 also gathers twice per micro-batch: "
                f"{right[1]:g}")
    return f"not quite: stage 2 {two:g}, stage 3 {three:g}; think what each stage repeats"


def check_offload_bound(answer) -> str:
    """Exercise 2: what bounds a ZeRO-Offload step (delayed update) of 8 A100 sharing a DGX
    A100's sockets at 1024 tokens per GPU: "compute", "link" or "host adam"."""
    if answer is None:
        return "not yet: set answer to 'compute', 'link' or 'host adam'"
    n, bandwidth = OFFLOAD_SETUPS["a DGX A100: 8 A100 sharing 2 sockets"]
    e = cost.zero_offload_step(10**9, 1024, "NVIDIA A100", "PCIe 4.0 x16", bandwidth, n)
    if str(answer).strip().lower() == e["bottleneck"]:
        return (f"right: compute {e['compute_s'] * 1e3:.0f} ms, link "
                f"{e['transfer_s'] * 1e3:.0f} ms, host Adam {e['adam_s'] * 1e3:.0f} ms per "
                "billion parameters")
    return f"not quite: {answer!r} is not the largest of the three"


def check_token_weight(answer) -> str:
    """Exercise 3: micro-batches of 30 and 90 real tokens, each loss the mean over its own
    tokens, the two averaged: how many times more a token of the short one weighs."""
    if answer is None:
        return "not yet: set answer to a number"
    right = (1 / (2 * 30)) / (1 / (2 * 90))
    if abs(float(answer) - right) <= 1e-9 * right:
        return ("right: 1/(2 x 30) against 1/(2 x 90) per token, 3 times; over the whole "
                "batch every token weighs 1/120")
    return f"not quite: {answer} is {'too high' if float(answer) > right else 'too low'}"


def check_prefetch_layers(answer) -> str:
    """Exercise 1: with ``ZeroStep(..., prefetch=2)``, how many layers' full weights a device
    may hold at once in the forward pass (the layer it computes and those prefetched)."""
    if answer is None:
        return "not yet: set answer to a whole number of layers"
    try:
        layers = int(answer)
    except (TypeError, ValueError):
        return f"not quite: give a whole number, got {answer!r}"
    if layers == 3:
        return ("right: the gather of layer l waits for layer l - 3, so layers l - 2, l - 1 "
                "and l may be gathered at once, p + 1 = 3; run it and compare the peak")
    return f"not quite: {layers}; count the layer computed and the p prefetched"


def check_stage_for_budget(answer) -> str:
    """Exercise 2: 13 billion parameters, mixed-precision Adam (16 B/param), 8 GPUs, 40 GB per
    GPU for the model states: the lowest ZeRO stage that fits, and the bytes it sends per step
    over stage 1's: a pair (stage, ratio)."""
    if answer is None:
        return "not yet: set answer to a pair (stage, bytes sent over stage 1's)"
    try:
        stage, ratio = int(answer[0]), float(answer[1])
    except (TypeError, ValueError, IndexError):
        return f"not quite: give (stage, ratio), got {answer!r}"
    fits = [s for s in cost.STAGES if cost.zero_total_bytes(13 * 10**9, 8, s) <= 40e9]
    right = min(fits)
    want = cost.zero_comm_bytes(13 * 10**9, 8, right) / cost.zero_comm_bytes(13 * 10**9, 8, 1)
    if stage == right and abs(ratio - want) <= 0.01 * want:
        sizes = ", ".join(f"stage {s} {cost.zero_total_bytes(13 * 10**9, 8, s) / 1e9:g} GB"
                          for s in cost.STAGES)
        return f"right: {sizes}; it sends {want:g} times stage 1's bytes"
    return f"not quite: stage {stage}, ratio {ratio:g}; count each stage's bytes per GPU"
