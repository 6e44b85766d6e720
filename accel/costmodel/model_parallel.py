"""A cost model (not a measurement) of naive model parallelism on real GPUs: a model too big
for one GPU split into ``p`` consecutive parts, one mini-batch at a time.

Per training step (forward + backward, no micro-batches): the parts run one after another, so

* compute time = the whole model's FLOPs / (peak x utilisation), the same as on one device;
* each of the ``p - 1`` boundaries carries the activation forward and its gradient backward
  (``2 (p - 1)`` transfers of ``tokens x hidden x bytes``), each at the link's bandwidth;
* every device works ``1 / p`` of the compute time: idle share ``1 - compute / (p x step)``,
  ``(p - 1) / p`` when transfers are free.

``naive_split(...)`` returns those figures; ``example_rows()`` a worked example (a 7-billion
parameter transformer-like model on A100 GPUs, over PCIe 4.0 and NVLink 3). Memory per
parameter of mixed-precision Adam training: 16 bytes (fp16 weights and gradients, fp32 master
weights, momentum and variance), Rajbhandari et al., "ZeRO", SC 2020, section 3.1.

Today's GPUs (``gpu_capacities``, ``smallest_gpu``: data-sheet memory within the planner's
``MEMORY_BUDGET``); memory on the first of ``p`` GPUs holding consecutive layers of a 7B-class
transformer, with and without recomputation or fused attention (``memory_rows``, from
``accel.costmodel.planner.memory_per_device``); naive model parallelism's step on H100s
(``time_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

from accel import checks
from accel.costmodel import planner as pl
from accel.costmodel.hardware import MEMORY_GB, link_bandwidth, peak_flops
from accel.costmodel.zero import ADAM_MIXED_BYTES_PER_PARAM

__all__ = ["BYTES_PER_PARAM_ADAM_MIXED", "A100_MEMORY_GB", "naive_split", "example_rows",
           "format_rows", "GPUS", "gpu_capacities", "format_capacities", "smallest_gpu", "EXAMPLE",
           "MEMORY_CASES", "memory_rows", "format_memory_rows", "time_rows"]

BYTES_PER_PARAM_ADAM_MIXED = ADAM_MIXED_BYTES_PER_PARAM  # accel.costmodel.zero's table: 16
A100_MEMORY_GB = MEMORY_GB["NVIDIA A100"].value  # accel.costmodel.hardware's figure: 80


def naive_split(params: float, tokens: int, hidden: int, num_gpus: int, link: str,
                device: str = "NVIDIA A100", precision: str = "bf16", utilization: float = 0.5,
                activation_bytes: int = 2) -> dict[str, float]:
    """Step time, transfer time and idle share of ``params`` parameters split over
    ``num_gpus`` GPUs joined by ``link`` (a key of ``accel.costmodel.hardware.LINKS``), for a
    step of ``tokens`` tokens whose boundary activation is ``tokens x hidden``. Training FLOPs:
    6 x params x tokens (forward 2, backward 4)."""
    checks.positive_number("params", params)
    checks.positive_int("tokens", tokens)
    checks.positive_int("hidden", hidden)
    checks.positive_int("num_gpus", num_gpus)
    if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    compute = 6 * params * tokens / (peak_flops(device, precision) * utilization)
    boundary = tokens * hidden * activation_bytes
    transfer = 2 * (num_gpus - 1) * boundary / link_bandwidth(link)
    step = compute + transfer
    return {"gpus": num_gpus, "memory_per_gpu_gb": params * BYTES_PER_PARAM_ADAM_MIXED
            / num_gpus / 1e9, "compute_s": compute, "transfer_s": transfer, "step_s": step,
            "idle_fraction": 1 - compute / (num_gpus * step),
            "expected_idle": (num_gpus - 1) / num_gpus}


def example_rows(params: float = 7e9, tokens: int = 8 * 2048, hidden: int = 4096) -> list[dict]:
    """The worked example: 1, 2 and 4 A100s, over PCIe 4.0 x16 and NVLink 3."""
    rows = []
    for link in ("PCIe 4.0 x16", "NVLink 3 (A100, per GPU)"):
        for n in (1, 2, 4):
            rows.append({"link": link, **naive_split(params, tokens, hidden, n, link)})
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as a table (times in ms, idle share)."""
    lines = [f"{'link':26} {'GPUs':>4} {'compute':>9} {'transfers':>9} {'step':>9} {'idle':>6} "
             f"{'(p-1)/p':>8}"]
    for r in rows:
        lines.append(f"{r['link']:26} {r['gpus']:>4} "
                     f"{r['compute_s'] * 1e3:>7.0f}ms {r['transfer_s'] * 1e3:>7.1f}ms "
                     f"{r['step_s'] * 1e3:>7.0f}ms {r['idle_fraction']:>6.2f} "
                     f"{r['expected_idle']:>8.2f}")
    return "\n".join(lines)


# today's GPUs, smallest memory first (accel.costmodel.hardware.MEMORY_GB: data sheets)
GPUS = ("NVIDIA A100", "NVIDIA H100 SXM", "NVIDIA H200 SXM", "NVIDIA B200", "AMD MI300X",
        "AMD MI325X", "NVIDIA B300", "AMD MI355X")


def gpu_capacities(budget: float = pl.MEMORY_BUDGET,
                   bytes_per_param: float = BYTES_PER_PARAM_ADAM_MIXED) -> list[dict]:
    """For each of ``GPUS``: its memory (GB), the ``budget`` share a plan may fill, and the
    parameters whose training state (``bytes_per_param`` each) fits in that share."""
    if not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget!r}")
    checks.positive_number("bytes_per_param", bytes_per_param)
    return [{"gpu": g, "gb": MEMORY_GB[g].value, "usable_gb": budget * MEMORY_GB[g].value,
             "params": budget * MEMORY_GB[g].value * 1e9 / bytes_per_param} for g in GPUS]


def format_capacities(rows: list[dict]) -> str:
    """``gpu_capacities`` as a table."""
    lines = [f"{'GPU':16} {'memory':>8} {'usable':>8}  {'parameters at 16 B':>18}"]
    lines += [f"{r['gpu']:16} {r['gb']:>5.0f} GB {r['usable_gb']:>5.0f} GB  "
              f"{r['params'] / 1e9:>14.1f} B" for r in rows]
    return "\n".join(lines)


def smallest_gpu(gb: float, budget: float = pl.MEMORY_BUDGET) -> str:
    """The GPUs of ``GPUS`` with the least memory whose ``budget`` share holds ``gb``
    (equal capacities joined by ``/``), or ``'none'``."""
    checks.non_negative_number("gb", gb)
    fits = [g for g in GPUS if gb <= budget * MEMORY_GB[g].value]
    if not fits:
        return "none"
    least = MEMORY_GB[fits[0]].value
    return " / ".join(_short(g) for g in fits if MEMORY_GB[g].value == least)


def _short(gpu: str) -> str:
    return gpu.replace("NVIDIA ", "").replace("AMD ", "").replace(" SXM", "")


# a 7B-class GPT (Llama-2-7B's shape with a tied embedding: Narayanan et al. eq. 2 gives
# 6.6e9 parameters), 8 sequences of 2048 tokens per step, one micro-batch (no pipelining)
EXAMPLE = {"model": pl.Transformer(layers=32, hidden=4096, heads=32, seq=2048, vocab=32000),
           "batch": 8}
MEMORY_CASES = (  # label -> (recompute, attention)
    ("no recompute", ("none", "materialized")),
    ("selective", ("selective", "materialized")),
    ("fused attention", ("none", "fused")),
    ("full recompute", ("full", "materialized")),
    ("full + fused", ("full", "fused")))


def memory_rows(gpus: Sequence[int] = (1, 2, 4, 8), example: dict | None = None) -> list[dict]:
    """GB on the first (most loaded) of ``p`` GPUs holding consecutive layers of ``example``
    (default ``EXAMPLE``), mixed-precision Adam state plus activations, for each of
    ``MEMORY_CASES`` (``accel.costmodel.planner.memory_per_device`` with ``pipeline=p``)."""
    e = EXAMPLE if example is None else example
    rows = []
    for p in gpus:
        row = {"gpus": checks.positive_int("gpus", p)}
        for label, (recompute, attention) in MEMORY_CASES:
            plan = pl.Plan(1, 1, p, microbatch=e["batch"], recompute=recompute,
                           attention=attention)
            mem = pl.memory_per_device(e["model"], plan, e["batch"])
            row["state"] = (mem.weights + mem.gradients + mem.optimizer) / 1e9
            row[label] = mem.total / 1e9
        rows.append(row)
    return rows


def format_memory_rows(rows: list[dict], budget: float = pl.MEMORY_BUDGET) -> str:
    """``memory_rows`` as a table: GB and the smallest GPU that holds it within ``budget``."""
    labels = ["state"] + [label for label, _ in MEMORY_CASES]
    lines = [f"{'GPUs':>4} " + " ".join(f"{k:>18}" for k in labels)]
    for r in rows:
        cells = [f"{r[k]:4.0f} GB {smallest_gpu(r[k], budget):>11}" for k in labels]
        lines.append(f"{r['gpus']:>4} " + " ".join(cells))
    return "\n".join(lines)


def time_rows(gpus: Sequence[int] = (1, 2, 4), device: str = "NVIDIA H100 SXM",
              links: Sequence[str] = ("PCIe 5.0 x16", "NVLink 4 (H100, per GPU)")) -> list[dict]:
    """``naive_split`` of ``EXAMPLE`` on ``device`` in bf16 at
    the planner's utilisation, over each of ``links``."""
    m, b = EXAMPLE["model"], EXAMPLE["batch"]
    return [{"link": link, **naive_split(m.parameters, b * m.seq, m.hidden, n, link,
                                                 device=device, precision="bf16",
                                                 utilization=pl.UTILIZATION)}
            for link in links for n in gpus]
