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

Memory per GPU on today's GPUs, with and without recomputation or fused attention, is
``accel.costmodel.planner.memory_per_device`` (chapter 09 prints it per GPU).
"""

from __future__ import annotations

from accel import checks
from accel.costmodel.hardware import MEMORY_GB, link_bandwidth, peak_flops
from accel.costmodel.zero import ADAM_MIXED_BYTES_PER_PARAM

__all__ = ["BYTES_PER_PARAM_ADAM_MIXED", "A100_MEMORY_GB", "naive_split", "example_rows",
           "format_rows"]

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
