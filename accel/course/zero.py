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
  hold the same weights;
* ``offload_with_host_adam`` / ``host_adam_break_even_tokens``: the offload cost model with the
  host's Adam pass (memory-bound) added, with and without ZeRO-Offload's delayed update.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from accel import collectives, timing
from accel.costmodel import zero as cost
from accel.models import mlp_apply, mlp_init
from accel.parallel.layers import dense, linear
from accel.parallel.offload import OffloadStep
from accel.parallel.zero import ZeroStep
from accel.training import squared_error

__all__ = ["SIZES", "NAMES", "mlp_layer_fns", "make_steps", "held_table", "sent_table",
           "time_steps", "bench", "figure_zero_memory", "copy_of", "same_weights",
           "HOST_ADAM_BYTES_PER_PARAM", "HOST_DRAM_BANDWIDTH", "HOST_DRAM_SOURCE",
           "offload_with_host_adam", "host_adam_break_even_tokens", "check_stage_bytes",
           "check_offload_tokens"]

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


# The host's Adam pass streams every parameter's state through DRAM once per step (ZeRO-Offload
# keeps fp32 weights, m and v on the CPU): the fp16 gradient read (2 bytes), the fp32 weight,
# m and v each read and written (24), the fp16 weight written for the copy back (2): 28 bytes
# per parameter, 28 GB per billion parameters (30 if the CPU keeps fp32 gradients, as
# ZeRO-Offload's g32). Adam's arithmetic (~10 FLOPs per parameter) is far below what the
# cores do in that time, so the pass is memory-bound.
HOST_ADAM_BYTES_PER_PARAM = 28
HOST_DRAM_SOURCE = ("peak DRAM bandwidth = channels x transfers/s x 8 bytes: AMD EPYC 7002 "
                    "(Rome, e.g. the 7742) has 8 channels of DDR4-3200 per socket, 204.8 GB/s "
                    "(AMD's EPYC 7002 specifications); NVIDIA's DGX A100 pairs 2 EPYC 7742 with "
                    "8 A100 GPUs (DGX A100 datasheet): 409.6 / 8 = 51.2 GB/s per GPU. Peaks: "
                    "STREAM reaches less")
HOST_DRAM_BANDWIDTH = {"a whole EPYC 7742 socket for one GPU": 204.8e9,
                       "a DGX A100's share per GPU": 51.2e9}


def offload_with_host_adam(params: int, tokens: int, device: str, link: str,
                           host_bandwidth: float, precision: str = "bf16",
                           utilization: float = 0.5) -> dict:
    """``accel.costmodel.zero.offload_step`` plus ``adam_s``, the host's Adam pass
    (``HOST_ADAM_BYTES_PER_PARAM`` per parameter at ``host_bandwidth`` bytes/s), and two step
    times: ``serial_s``, Adam after the backward as plain offload runs it (the accelerator
    waits for it: a lower bound, the weights' copy back after Adam also waits), and ``dpu_s``,
    ZeRO-Offload's delayed parameter update (Adam of step t runs while the accelerator computes
    step t+1 from weights one step old): the largest of compute, transfer and Adam."""
    e = cost.offload_step(params, tokens, device, link, precision, utilization)
    adam = HOST_ADAM_BYTES_PER_PARAM * params / host_bandwidth
    return {**e, "adam_s": adam, "serial_s": max(e["compute_s"], e["transfer_s"]) + adam,
            "dpu_s": max(e["compute_s"], e["transfer_s"], adam)}


def host_adam_break_even_tokens(device: str, host_bandwidth: float, precision: str = "bf16",
                                utilization: float = 0.5) -> float:
    """Tokens per GPU and step from which the host's Adam hides under the compute (with the
    delayed update): ``6 params tokens / R = 28 params / B_host``, whatever the model's size."""
    from accel.costmodel.hardware import peak_flops

    rate = peak_flops(device, precision) * utilization
    return HOST_ADAM_BYTES_PER_PARAM * rate / (6 * host_bandwidth)


def check_stage_bytes(answer) -> str:
    """Exercise 1: bytes one device holds, float32 Adam, 1e9 parameters, 8 devices, stage 2."""
    if answer is None:
        return "not yet: set answer to a number of bytes"
    right = cost.zero_total_bytes(10**9, 8, 2, "fp32")
    if answer == right:
        return f"right: 4 bytes x 1e9 weights + 12 bytes x 1e9 / 8 = {right:.3g} bytes"
    return f"not quite: {answer} is {'too high' if answer > right else 'too low'}"


def check_offload_tokens(answer) -> str:
    """Exercise 2: tokens per GPU and step from which offload over PCIe 5.0 x16 is free for an
    H100 at 50% of its bf16 peak (within 1%)."""
    if answer is None:
        return "not yet: set answer to a number of tokens"
    right = cost.offload_break_even_tokens("NVIDIA H100 SXM", "PCIe 5.0 x16", "bf16")
    if abs(answer - right) <= 0.01 * right:
        return (f"right: 2 bytes x (50% of 989.4e12 FLOP/s) / (6 FLOPs x 63e9 B/s) = {right:.0f}"
                " tokens")
    return f"not quite: {answer} is {'too high' if answer > right else 'too low'}"
