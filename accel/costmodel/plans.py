"""The planner's search: every data x tensor x pipeline x ZeRO plan of a model on a cluster,
evaluated with ``accel.costmodel.planner`` (a MODEL), the ones that fit ranked by step time; and
a rule of thumb to rank beside it.

* ``candidate_plans``: tensor sizes dividing the heads and the GPUs, each filling part of one
  node or whole nodes (a group never straddles a node boundary unevenly; with ranks ordered
  tensor first, a group of at most a node's GPUs sits inside one node), pipeline sizes dividing
  the layers (equal stages) and the rest, data replicas splitting the global batch, each ZeRO
  stage (only 0 with one replica), each micro-batch size (1, 2, 4, 8 by default), and each
  value given of the options: ``recompute`` (``planner.RECOMPUTE``), ``attention``
  (``planner.ATTENTION``), ``sequence_parallel``
  (only with a tensor group), ``interleave`` (only with a pipeline, when the layers split into
  ``p v`` equal chunks and the micro-batches into multiples of ``p``), ``overlap``. The
  defaults (``BASIC``) are the simplest set: full recomputation or none, scores materialized,
  no sequence parallelism, plain 1F1B, no overlap; ``LATER`` adds selective recomputation,
  sequence parallelism, interleaving and overlap (attention stays materialized unless asked);
* ``evaluate`` / ``rank_plans``: memory and time of each plan; the plans that fit in
  ``memory_budget`` of a GPU's memory (``planner.MEMORY_BUDGET``, 0.8), fastest first (ties:
  least memory); a model that fits no plan is a ``ValueError`` that tries each option left out
  of the search and says which one closes the gap, or that none does and what would (the fewest
  nodes with a plan that fits, or the optimizer states moved to the host);
* ``distinct_layouts``: the (tensor, pipeline) pairs in ranked order, each once;
* ``rule_layouts``: the same fitting layouts in the order of Narayanan et al. 2021's Takeaways
  #1 and #2 (section 3.2): "tensor model parallelism should generally be used up to degree g
  when using g-GPU servers, and then pipeline model parallelism can be used to scale up to
  larger models across servers", with "a total model-parallel size of M = t·p" just large
  enough that the model fits, data parallelism for the rest;
* ``format_plans``: a ranked list as a table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from accel import checks
from accel.costmodel.planner import (
    ATTENTION,
    MEMORY_BUDGET,
    PRECISION,
    RECOMPUTE,
    UTILIZATION,
    Cluster,
    Memory,
    Plan,
    StepTime,
    Transformer,
    memory_per_device,
    state_bytes,
    step_time,
)

__all__ = ["MICROBATCH_SIZES", "BASIC", "LATER", "Evaluated", "candidate_plans", "evaluate",
           "rank_plans", "distinct_layouts", "rule_layouts", "format_plans"]

GB = 1e9
MICROBATCH_SIZES = (1, 2, 4, 8)
# the options searched: the simplest set, and what the later chapters add
BASIC = {"recompute": ("full", "none"), "sequence_parallel": (False,), "interleave": (1,),
         "overlap": (False,)}
LATER = {"recompute": RECOMPUTE, "sequence_parallel": (False, True), "interleave": (1, 2, 4),
         "overlap": (False, True)}


@dataclass(frozen=True)
class Evaluated:
    """A plan with its modelled memory per device and step time."""

    plan: Plan
    memory: Memory
    time: StepTime


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _check_options(recompute, sequence_parallel, interleave, overlap,
                   attention=("materialized",)) -> None:
    for r in recompute:
        if r not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {r!r}")
    for x in attention:
        checks.one_of("attention", x, ATTENTION)
    for name, values in (("sequence_parallel", sequence_parallel), ("overlap", overlap)):
        for x in values:
            if not isinstance(x, bool):
                raise ValueError(f"{name} values must be True or False, got {x!r}")
    for v in interleave:
        checks.positive_int("interleave", v)


def candidate_plans(model: Transformer, cluster: Cluster, batch: int,
                    zero_stages: Sequence[int] = (0, 1, 2, 3),
                    microbatch_sizes: Sequence[int] = MICROBATCH_SIZES,
                    recompute: Sequence[str] = BASIC["recompute"],
                    sequence_parallel: Sequence[bool] = BASIC["sequence_parallel"],
                    interleave: Sequence[int] = BASIC["interleave"],
                    overlap: Sequence[bool] = BASIC["overlap"],
                    attention: Sequence[str] = ("materialized",)) -> list[Plan]:
    """Every plan of ``cluster.gpus`` GPUs that the model, the global ``batch`` and the options
    allow."""
    checks.positive_int("batch", batch)
    for z in zero_stages:
        checks.one_of("zero stage", z, (0, 1, 2, 3))
    for b in microbatch_sizes:
        checks.positive_int("micro-batch size", b)
    _check_options(recompute, sequence_parallel, interleave, overlap, attention)
    n, out = cluster.gpus, []
    per_node = cluster.gpus_per_node
    for t in _divisors(n):
        if model.heads % t or (per_node % t and t % per_node):
            continue  # a tensor group fills part of one node, or whole nodes
        sps = sorted({sp for sp in sequence_parallel if t > 1 or not sp})
        for p in _divisors(n // t):
            d = n // (t * p)
            if model.layers % p:
                continue
            for b in microbatch_sizes:
                if batch % (d * b):
                    continue
                m = batch // (d * b)
                vs = sorted({v for v in interleave if v == 1 or (
                    p > 1 and model.layers % (p * v) == 0 and m % p == 0)})
                for z in (zero_stages if d > 1 else [0]):  # ZeRO over 1 replica: plain
                    out += [Plan(d, t, p, z, b, r, sp, v, o, a) for r in recompute
                            for sp in sps for v in vs for o in overlap for a in attention]
    return out


def evaluate(model: Transformer, cluster: Cluster, plans: Sequence[Plan], batch: int,
             precision: str = PRECISION,
             utilization: float = UTILIZATION) -> list[Evaluated]:
    """Memory and step time of each plan (fitting or not), in the order given."""
    return [Evaluated(p, memory_per_device(model, p, batch, precision),
                      step_time(model, cluster, p, batch, precision, utilization))
            for p in plans]


def _least(model, cluster, batch, precision, search) -> tuple[Plan, Memory] | None:
    """The plan of least memory among ``candidate_plans(..., **search)`` (memory only)."""
    best = None
    for plan in candidate_plans(model, cluster, batch, **search):
        mem = memory_per_device(model, plan, batch, precision)
        if best is None or mem.total < best[1].total:
            best = (plan, mem)
    return best


def _no_fit_message(model: Transformer, cluster: Cluster, batch: int, search: dict,
                    precision: str, budget: float, utilization: float) -> str:
    """Each option left out of ``search``, applied in the model: which closes the gap; if none
    does, every option at once, then what would: the fewest nodes of the same kind with a plan
    that fits (its fastest plan), and the optimizer states moved to host memory."""
    have = cluster.memory_bytes * budget
    plan, mem = _least(model, cluster, batch, precision, search)
    lines = [f"no plan of {model.parameters / 1e9:.1f}B parameters fits {cluster.gpus} GPUs of "
             f"{have / GB:.0f} GB ({budget:.0%} of {cluster.memory_bytes / GB:.0f}): the least "
             f"memory is {mem.total / GB:.1f} GB per GPU ({plan.label}), "
             f"{(mem.total - have) / GB:.1f} GB missing"]
    widest = {"zero_stages": (0, 1, 2, 3), "microbatch_sizes": tuple(
        sorted({1, *search["microbatch_sizes"]})), "recompute": RECOMPUTE,
        "sequence_parallel": (False, True), "interleave": (1,), "overlap": (False,),
        "attention": ATTENTION}
    tried = []
    for key, value in (("recompute", "full"), ("recompute", "selective"), ("zero_stages", 1),
                       ("zero_stages", 2), ("zero_stages", 3), ("sequence_parallel", True),
                       ("attention", "fused"), ("microbatch_sizes", 1)):
        if value in search[key]:
            continue
        wider = dict(search, **{key: tuple(search[key]) + (value,)})
        tried.append((f"{key}={value!r}", _least(model, cluster, batch, precision, wider)[1]))
    for name, least in tried:
        lines.append(f"  with {name}: least {least.total / GB:.1f} GB"
                     f"{' -- fits' if least.total <= have else ''}")
    if any(least.total <= have for _, least in tried):
        return "\n".join(lines)
    _, every = _least(model, cluster, batch, precision, widest)
    if every.total <= have:
        lines.append(f"  every option at once: least {every.total / GB:.1f} GB -- fits")
        return "\n".join(lines)
    lines.append(f"  every option at once: least {every.total / GB:.1f} GB -- no option of the "
                 "search closes the gap; what would:")
    for nodes in range(cluster.nodes + 1, 64 * cluster.nodes + 1):
        bigger = dataclasses.replace(cluster, nodes=nodes)
        found = _least(model, bigger, batch, precision, widest)
        if found is not None and found[1].total <= have:
            fastest = rank_plans(model, bigger, batch, precision=precision,
                                 utilization=utilization, memory_budget=budget, **widest)[0]
            lines.append(f"  more GPUs: {nodes} nodes ({bigger.gpus} GPUs), the fastest plan "
                         f"{fastest.plan.label}: {fastest.memory.total / GB:.1f} GB")
            break
    else:
        lines.append(f"  more GPUs: no cluster of up to {64 * cluster.nodes} nodes fits")
    # ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840, section 4): the 16-bit gradients go to
    # the host as the backward makes them, the fp32 master weights and Adam's moments live there
    # and the optimizer step runs on the CPU; each GPU keeps its 16-bit weights and activations
    best = min((memory_per_device(model, p, batch, precision)
                for p in candidate_plans(model, cluster, batch, **widest)),
               key=lambda m: m.weights + m.activations + m.working)
    _, grads, states = state_bytes(model.parameters, precision)
    host, per_node = grads + states, (grads + states) / cluster.nodes
    on_gpu = best.weights + best.activations + best.working
    verdict = "" if not cluster.host_memory_bytes else (
        f", {'within' if per_node <= cluster.host_memory_bytes else 'over'} the node's "
        f"{cluster.host_memory_bytes / 1e12:.1f} TB")
    lines.append(f"  ZeRO-Offload (chapter 15: gradients, optimizer states and step on the host): "
                 f"least {on_gpu / GB:.1f} GB per GPU; host "
                 f"{(grads + states) / model.parameters:.0f} B/param, {host / 1e12:.2f} TB "
                 f"({per_node / 1e12:.2f} TB per node{verdict})")
    return "\n".join(lines)


def rank_plans(model: Transformer, cluster: Cluster, batch: int,
               zero_stages: Sequence[int] = (0, 1, 2, 3),
               microbatch_sizes: Sequence[int] = MICROBATCH_SIZES,
               recompute: Sequence[str] = BASIC["recompute"],
               sequence_parallel: Sequence[bool] = BASIC["sequence_parallel"],
               interleave: Sequence[int] = BASIC["interleave"],
               overlap: Sequence[bool] = BASIC["overlap"],
               attention: Sequence[str] = ("materialized",), precision: str = PRECISION,
               utilization: float = UTILIZATION,
               memory_budget: float = MEMORY_BUDGET) -> list[Evaluated]:
    """The plans that fit in ``memory_budget`` of ``cluster.memory_bytes``, fastest first (then
    least memory)."""
    if not 0 < memory_budget <= 1:
        raise ValueError(f"memory_budget must be in (0, 1], got {memory_budget!r}")
    search = {"zero_stages": tuple(zero_stages), "microbatch_sizes": tuple(microbatch_sizes),
              "recompute": tuple(recompute), "sequence_parallel": tuple(sequence_parallel),
              "interleave": tuple(interleave), "overlap": tuple(overlap),
              "attention": tuple(attention)}
    plans = candidate_plans(model, cluster, batch, **search)
    if not plans:
        raise ValueError(f"no plan splits {cluster.gpus} GPUs for heads={model.heads}, "
                         f"layers={model.layers} and batch={batch}: use a batch that is a "
                         f"multiple of the data-parallel size, or another GPU count")
    have = memory_budget * cluster.memory_bytes
    fits = [p for p in plans if memory_per_device(model, p, batch, precision).total <= have]
    if not fits:
        raise ValueError(_no_fit_message(model, cluster, batch, search, precision,
                                         memory_budget, utilization))
    rows = evaluate(model, cluster, fits, batch, precision, utilization)
    return sorted(rows, key=lambda r: (r.time.step_s, r.memory.total))


def distinct_layouts(rows: Sequence[Evaluated]) -> list[tuple[int, int]]:
    """The (tensor, pipeline) pairs of ``rows``, in order, each once."""
    seen: list[tuple[int, int]] = []
    for r in rows:
        key = (r.plan.tensor, r.plan.pipeline)
        if key not in seen:
            seen.append(key)
    return seen


def rule_layouts(layouts: Sequence[tuple[int, int]], gpus_per_node: int) -> list[tuple[int, int]]:
    """``layouts`` (the (t, p) pairs that fit) in the order of Narayanan et al.'s Takeaways #1
    and #2: tensor parallelism first, up to ``gpus_per_node``, pipeline parallelism beyond it
    (the layouts with ``p = 1, t <= g`` or ``t = g``), the smallest model-parallel size ``t p``
    first; layouts the rule would never pick (``t < g`` with ``p > 1``, or ``t > g``) follow,
    by ``t p`` then ``p``."""
    g = checks.positive_int("gpus_per_node", gpus_per_node)
    for t, p in layouts:
        checks.positive_int("tensor", t)
        checks.positive_int("pipeline", p)

    def key(layout):
        t, p = layout
        return (0 if (p == 1 and t <= g) or t == g else 1, t * p, p)
    return sorted(dict.fromkeys(layouts), key=key)


def format_plans(rows: Sequence[Evaluated], top: int = 5) -> str:
    """The first ``top`` rows: layout, options, memory per GPU (GB), step time and its parts
    (s). ``rc``: recomputation (no, sel, full); ``sp``: sequence parallelism; ``v``: chunks per
    pipeline device; ``ov``: overlap of the data-parallel traffic; ``fa``: fused attention."""
    lines = [f"{'d':>4} {'t':>2} {'p':>3} {'ZeRO':>4} {'b':>2} {'rc':>4} {'sp':>2} {'v':>1} "
             f"{'ov':>2} {'GB/GPU':>6} {'step s':>7} {'compute':>7} {'TP':>5} {'bubble':>6} "
             f"{'DP':>5} {'TF/s/GPU':>8} {'fa':>2}"]
    short = {"none": "no", "selective": "sel", "full": "full"}
    for r in rows[:checks.positive_int("top", top)]:
        p, m, t = r.plan, r.memory, r.time
        lines.append(f"{p.data:>4} {p.tensor:>2} {p.pipeline:>3} {p.zero:>4} {p.microbatch:>2} "
                     f"{short[p.recompute]:>4} {'y' if p.sequence_parallel else '-':>2} "
                     f"{p.interleave:>1} {'y' if p.overlap else '-':>2} {m.total / GB:>6.1f} "
                     f"{t.step_s:>7.2f} {t.compute_s:>7.2f} {t.tensor_s:>5.2f} "
                     f"{t.bubble_s:>6.2f} {t.data_s:>5.2f} {t.tflops_per_gpu:>8.0f} "
                     f"{'y' if p.attention == 'fused' else '-':>2}")
    return "\n".join(lines)
