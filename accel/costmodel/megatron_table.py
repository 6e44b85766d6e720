"""The planner against a published table: Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC21, arXiv:2104.04473), Table 1: GPT models
of 1.7 billion to 1 trillion parameters (sequence 2048, vocabulary 51200) trained on up to 3072
A100 80 GB GPUs of NVIDIA's Selene (DGX A100 nodes), with the tensor (t) and pipeline (p) sizes
the authors chose and the per-GPU throughput they REPORT (eq. 3's FLOPs per second).

``compare()`` asks the planner, for each row, with the paper's own settings for what Table 1
leaves fixed (full activation recomputation, no ZeRO, and micro-batches of one sequence: an
assumption, as Table 1 does not list the micro-batch size):

* where the published (t, p) ranks among the planner's distinct (t, p) layouts;
* the modelled per-GPU throughput of the published configuration, and its error.

Nothing is fitted to this table: the utilisation is the course's ``planner.UTILIZATION``.
"""

from __future__ import annotations

import statistics

from accel.costmodel.planner import (
    UTILIZATION,
    Cluster,
    Plan,
    Transformer,
    memory_per_device,
    step_time,
)
from accel.costmodel.plans import distinct_layouts, rank_plans

__all__ = ["SOURCE", "TABLE1", "SEQ", "VOCAB", "compare", "summary", "format_comparison"]

SOURCE = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
          "Clusters Using Megatron-LM', arXiv:2104.04473, Table 1")
SEQ, VOCAB = 2048, 51200
# REPORTED: (billions of parameters, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU)
TABLE1: list[tuple[float, int, int, int, int, int, int, int, int]] = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def compare(utilization: float = UTILIZATION, top: int = 3) -> list[dict]:
    """One dict per row of ``TABLE1``: the published figures, the planner's first ``top``
    (t, p) layouts, the published layout's rank (None if no fitting plan has it), the
    modelled throughput of the published configuration and its relative error."""
    out = []
    for params, heads, hidden, layers, t, p, gpus, batch, tflops in TABLE1:
        model = Transformer(layers, hidden, heads, SEQ, VOCAB)
        cluster = Cluster.dgx_a100(nodes=1, gpus=gpus)
        ranked = rank_plans(model, cluster, batch, zero_stages=(0,), recompute=(True,),
                            utilization=utilization)
        layouts = distinct_layouts(ranked)
        plan = Plan(gpus // (t * p), t, p)
        modelled = step_time(model, cluster, plan, batch, utilization=utilization)
        memory = memory_per_device(model, plan, batch)
        out.append({
            "params_b": params, "model_params_b": model.parameters / 1e9, "gpus": gpus,
            "published": (t, p), "published_tflops": tflops,
            "planner_top": layouts[:top],
            "rank": layouts.index((t, p)) + 1 if (t, p) in layouts else None,
            "modelled_tflops": modelled.tflops_per_gpu,
            "error": modelled.tflops_per_gpu / tflops - 1,
            "published_gb": memory.total / 1e9,
            "fits": memory.total <= cluster.memory_bytes,
        })
    return out


def summary(rows: list[dict], top: int = 3, tolerance: float = 0.25) -> dict:
    """How many rows have the published layout in the top ``top``, how many are within
    ``tolerance``, the median absolute error, and the rows that miss either (by size)."""
    in_top = [r for r in rows if r["rank"] is not None and r["rank"] <= top]
    close = [r for r in rows if abs(r["error"]) <= tolerance]
    missed = [r["params_b"] for r in rows if r not in in_top or r not in close]
    return {"rows": len(rows), "in_top": len(in_top), "within": len(close),
            "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
            "missed": missed}


def format_comparison(rows: list[dict]) -> str:
    """Published vs planner, one line per model."""
    lines = [f"{'params':>7} {'GPUs':>5} {'published':>9} {'planner top 3':>24} {'rank':>4} "
             f"{'GB/GPU':>6} {'TF/s pub.':>9} {'model':>6} {'error':>6}"]
    for r in rows:
        top = " ".join(f"({t},{p})" for t, p in r["planner_top"])
        rank = "-" if r["rank"] is None else str(r["rank"])
        lines.append(f"{r['params_b']:>6.1f}B {r['gpus']:>5} {str(r['published']):>9} "
                     f"{top:>24} {rank:>4} {r['published_gb']:>6.1f} "
                     f"{r['published_tflops']:>9} {r['modelled_tflops']:>6.0f} "
                     f"{r['error']:>+6.0%}")
    return "\n".join(lines)
