"""The planner against a published table: Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC21, arXiv:2104.04473), Table 1: GPT models
of 1.7 billion to 1 trillion parameters (sequence 2048, vocabulary 51200) benchmarked on up to
3072 A100 80 GB GPUs of NVIDIA's Selene (DGX A100 nodes), with the tensor (t) and pipeline (p)
sizes the authors chose and the per-GPU throughput they REPORT (eq. 3's FLOPs per second). These
were throughput benchmarks, not trainings to convergence (NVIDIA/Megatron-LM README, "Training
Speed and Scalability": "these results are from benchmark runs and these models were not
trained to convergence").

``compare()`` asks the planner, for each row, with the paper's own settings for what Table 1
leaves fixed (full activation recomputation, no ZeRO, and micro-batches of one sequence for the
published configuration: an assumption, as Table 1 does not list the micro-batch size):

* where the published (t, p) ranks among the planner's distinct (t, p) layouts that fit, and
  where it ranks in the order of the paper's own rule of thumb (``plans.rule_layouts``:
  Takeaways #1 and #2, tensor parallelism up to a node, then the smallest pipeline that fits),
  with the number of layouts that fit;
* the modelled per-GPU throughput of the published configuration, and its error;
* beside it a TRIVIAL baseline, ``u x 312 TFLOP/s`` per GPU with no communication at all.

The two utilisations (the planner's compute share, the baseline's) are FITTED on the three
smallest rows (``FIT_ROWS``: data and tensor parallelism only) and scored on the other seven,
so neither is scored on the rows it was set from. For scale: the best bf16 matmul an A100 SXM
reaches is 267.9 TFLOP/s, 86% of the peak (``GEMM_CEILING``); a training step, with its
softmax, LayerNorms and element-wise kernels, gets less.

``compare_table2()`` is the out-of-sample check: Table 2 of the same paper, PTD-P against ZeRO-3
without model parallelism (``TABLE2``), with the utilisations fitted on Table 1, each step
bounded between no overlap and full overlap of its data-parallel traffic with the compute.
Table 2 gives PTD-P's model-parallel size only (t p = 96 and 280); the split t = 8 (one DGX A100
node) x p = 12 and 35 is inferred: Takeaway #1, and p = 35 is Table 1's layout of the same
529.6B model. The same split is what cli99/llm-analysis uses to reproduce Table 2's training
times (``examples/megatron-lm/run_train.sh``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from accel import checks
from accel.costmodel.planner import (
    MEMORY_BUDGET,
    Cluster,
    Plan,
    Transformer,
    memory_per_device,
    step_time,
)
from accel.costmodel.plans import distinct_layouts, rank_plans, rule_layouts

__all__ = ["SOURCE", "TABLE1", "SEQ", "VOCAB", "FIT_ROWS", "GEMM_CEILING", "TABLE2_SOURCE",
           "TABLE2", "fit_utilization", "trivial_tflops", "compare", "summary",
           "format_comparison", "compare_table2", "format_table2"]

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


FIT_ROWS = 3  # the utilisations are fitted on TABLE1's first rows, scored on the rest
PEAK_TFLOPS = 312.0  # A100 bf16 dense peak (accel.costmodel.hardware)
GEMM_CEILING = (267.9, "S. Bekman, 'Machine Learning Engineering', compute/accelerator/README.md, "
                       "'Maximum Achievable Matmul FLOPS comparison table': NVIDIA A100 SXM, "
                       "bf16 matmul, 267.9 of 312 TFLOP/s (85.9%), CUDA 12.1")

TABLE2_SOURCE = (
    "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM', SC'21, arXiv:2104.04473, Table 2 (PTD-P vs ZeRO-3 without model "
    "parallelism). PTD-P's t = 8 x p = 12 and 35 are inferred from its model-parallel sizes "
    "96 and 280 (Takeaway #1; p = 35 is Table 1's layout of the 529.6B model)")
# REPORTED: (scheme, billions, layers, hidden, heads, (t, p), batch, GPUs, micro-batch, TFLOP/s)
# the 640-GPU ZeRO-3 row ran a larger batch (2560) than the other 529.6B rows (2240)
TABLE2: list[tuple] = [
    ("ZeRO-3", 174.6, 96, 12288, 96, (1, 1), 1536, 384, 4, 144),
    ("ZeRO-3", 174.6, 96, 12288, 96, (1, 1), 1536, 768, 2, 88),
    ("ZeRO-3", 174.6, 96, 12288, 96, (1, 1), 1536, 1536, 1, 44),
    ("ZeRO-3", 529.6, 105, 20480, 128, (1, 1), 2560, 640, 4, 138),
    ("ZeRO-3", 529.6, 105, 20480, 128, (1, 1), 2240, 1120, 2, 98),
    ("ZeRO-3", 529.6, 105, 20480, 128, (1, 1), 2240, 2240, 1, 48),
    ("PTD-P", 174.6, 96, 12288, 96, (8, 12), 1536, 384, 1, 153),
    ("PTD-P", 174.6, 96, 12288, 96, (8, 12), 1536, 768, 1, 149),
    ("PTD-P", 174.6, 96, 12288, 96, (8, 12), 1536, 1536, 1, 141),
    ("PTD-P", 529.6, 105, 20480, 128, (8, 35), 2240, 560, 1, 171),
    ("PTD-P", 529.6, 105, 20480, 128, (8, 35), 2240, 1120, 1, 167),
    ("PTD-P", 529.6, 105, 20480, 128, (8, 35), 2240, 2240, 1, 159),
]


def _published_plan(row) -> tuple[Transformer, Cluster, Plan, int]:
    _, heads, hidden, layers, t, p, gpus, batch, _ = row
    return (Transformer(layers, hidden, heads, SEQ, VOCAB), Cluster.dgx_a100(nodes=1, gpus=gpus),
            Plan(gpus // (t * p), t, p), batch)


def _planner_tflops(row, utilization: float) -> float:
    model, cluster, plan, batch = _published_plan(row)
    return step_time(model, cluster, plan, batch, utilization=utilization).tflops_per_gpu


def trivial_tflops(utilization: float) -> float:
    """The trivial model: ``utilization`` of the A100's 312 TFLOP/s, no communication."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return utilization * PEAK_TFLOPS


def fit_utilization(kind: str = "planner", rows: int = FIT_ROWS) -> float:
    """The utilisation that makes the ``kind`` model ("planner" or "trivial") right on average
    (geometric mean of modelled / published = 1) over ``TABLE1``'s first ``rows`` rows."""
    checks.one_of("kind", kind, ("planner", "trivial"))
    fit = TABLE1[:checks.positive_int("rows", rows)]
    if kind == "trivial":
        return math.exp(statistics.fmean(math.log(r[-1]) for r in fit)) / PEAK_TFLOPS

    def log_ratio(u):
        return statistics.fmean(math.log(_planner_tflops(r, u) / r[-1]) for r in fit)

    lo, hi = 0.05, 1.0  # the planner's throughput rises with u: bisect
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if log_ratio(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def compare(utilization: float | None = None, top: int = 3,
            memory_budget: float = MEMORY_BUDGET) -> list[dict]:
    """One dict per row of ``TABLE1``: the published figures, the planner's first ``top``
    (t, p) layouts, the published layout's rank among the distinct layouts that fit (None if
    no fitting plan has it) under the planner (``rank``) and under the rule of thumb
    (``rule_rank``, ``plans.rule_layouts``), how many layouts fit (``layouts``), the rule's
    first layout (``rule_first``), the modelled throughput of the published configuration, the
    trivial baseline's, their relative errors, and whether the row was used to fit
    (``fitted``). ``utilization``: the planner's (default: fitted); the baseline's is always
    fitted."""
    u = fit_utilization("planner") if utilization is None else utilization
    u_trivial = fit_utilization("trivial")
    out = []
    for i, row in enumerate(TABLE1):
        model, cluster, plan, batch = _published_plan(row)
        ranked = rank_plans(model, cluster, batch, zero_stages=(0,), recompute=("full",),
                            utilization=u, memory_budget=memory_budget)
        layouts = distinct_layouts(ranked)
        rule = rule_layouts(layouts, cluster.gpus_per_node)
        t, p, tflops = plan.tensor, plan.pipeline, row[-1]
        modelled = step_time(model, cluster, plan, batch, utilization=u)
        memory = memory_per_device(model, plan, batch)
        trivial = trivial_tflops(u_trivial)
        out.append({
            "params_b": row[0], "model_params_b": model.parameters / 1e9, "gpus": row[6],
            "published": (t, p), "published_tflops": tflops, "fitted": i < FIT_ROWS,
            "planner_top": layouts[:top],
            "rank": layouts.index((t, p)) + 1 if (t, p) in layouts else None,
            "rule_rank": rule.index((t, p)) + 1 if (t, p) in rule else None,
            "rule_first": rule[0], "layouts": len(layouts),
            "modelled_tflops": modelled.tflops_per_gpu,
            "error": modelled.tflops_per_gpu / tflops - 1,
            "trivial_tflops": trivial, "trivial_error": trivial / tflops - 1,
            "published_gb": memory.total / 1e9,
            "fits": memory.total <= memory_budget * cluster.memory_bytes,
            "utilization": u, "trivial_utilization": u_trivial,
        })
    return out


def summary(rows: list[dict], top: int = 3, tolerance: float = 0.25) -> dict:
    """Over the rows NOT used to fit: how many have the published layout in the top ``top``,
    first under the planner and first under the rule of thumb, how many the planner and the
    trivial baseline model within ``tolerance``, both median absolute errors, and the rows the
    planner misses (by size)."""
    held = [r for r in rows if not r["fitted"]]
    in_top = [r for r in held if r["rank"] is not None and r["rank"] <= top]
    close = [r for r in held if abs(r["error"]) <= tolerance]
    return {"rows": len(held), "in_top": len(in_top), "within": len(close),
            "first": sum(r["rank"] == 1 for r in held),
            "rule_first": sum(r["rule_rank"] == 1 for r in held),
            "trivial_within": sum(abs(r["trivial_error"]) <= tolerance for r in held),
            "median_abs_error": statistics.median(abs(r["error"]) for r in held),
            "trivial_median_abs_error": statistics.median(abs(r["trivial_error"]) for r in held),
            "missed": [r["params_b"] for r in held if r not in in_top or r not in close]}


def format_comparison(rows: list[dict]) -> str:
    """Published vs planner vs the trivial baseline, one line per model (* = fitted on):
    the published layout's rank under the planner and under the rule, of ``fit`` layouts."""
    lines = [f"{'params':>8} {'GPUs':>5} {'published':>9} {'planner top 3':>24} {'rank':>4} "
             f"{'rule':>4} {'fit':>3} {'GB/GPU':>6} {'TF/s pub.':>9} {'planner':>7} "
             f"{'error':>6} {'trivial':>7} {'error':>6}"]
    for r in rows:
        top = " ".join(f"({t},{p})" for t, p in r["planner_top"])
        rank, rule = ("-" if x is None else str(x) for x in (r["rank"], r["rule_rank"]))
        mark = "*" if r["fitted"] else " "
        lines.append(f"{r['params_b']:>6.1f}B{mark} {r['gpus']:>5} {str(r['published']):>9} "
                     f"{top:>24} {rank:>4} {rule:>4} {r['layouts']:>3} "
                     f"{r['published_gb']:>6.1f} "
                     f"{r['published_tflops']:>9} {r['modelled_tflops']:>7.0f} "
                     f"{r['error']:>+6.0%} {r['trivial_tflops']:>7.0f} "
                     f"{r['trivial_error']:>+6.0%}")
    return "\n".join(lines)


def compare_table2(utilization: float | None = None) -> list[dict]:
    """One dict per row of ``TABLE2``: the published throughput, the planner's with the
    data-parallel traffic not overlapped at all (``slow``, ``Plan(overlap=False)``) and
    overlapped as far as the model allows (``fast``), the trivial baseline's, and the planner's
    memory per GPU."""
    u = fit_utilization("planner") if utilization is None else utilization
    trivial = trivial_tflops(fit_utilization("trivial"))
    out = []
    for scheme, params, layers, hidden, heads, (t, p), batch, gpus, b, tflops in TABLE2:
        model = Transformer(layers, hidden, heads, SEQ, VOCAB)
        cluster = Cluster.dgx_a100(nodes=1, gpus=gpus)
        plan = Plan(gpus // (t * p), t, p, zero=3 if scheme == "ZeRO-3" else 0, microbatch=b)
        slow, fast = (step_time(model, cluster, dataclasses.replace(plan, overlap=o), batch,
                                utilization=u) for o in (False, True))
        out.append({"scheme": scheme, "params_b": params, "gpus": gpus, "microbatch": b,
                    "published_tflops": tflops, "slow_tflops": slow.tflops_per_gpu,
                    "fast_tflops": fast.tflops_per_gpu, "trivial_tflops": trivial,
                    "within_bounds": slow.tflops_per_gpu <= tflops <= fast.tflops_per_gpu,
                    "gb": memory_per_device(model, plan, batch).total / 1e9})
    return out


def format_table2(rows: list[dict]) -> str:
    """Table 2 next to the planner's bounds and the trivial baseline."""
    lines = [f"{'scheme':>7} {'params':>7} {'GPUs':>5} {'b':>2} {'TF/s pub.':>9} "
             f"{'planner (no overlap - full)':>27} {'trivial':>7} {'GB/GPU':>6}"]
    for r in rows:
        lines.append(f"{r['scheme']:>7} {r['params_b']:>6.1f}B {r['gpus']:>5} "
                     f"{r['microbatch']:>2} {r['published_tflops']:>9} "
                     f"{r['slow_tflops']:>16.0f} - {r['fast_tflops']:<8.0f} "
                     f"{r['trivial_tflops']:>7.0f} {r['gb']:>6.1f}")
    return "\n".join(lines)
