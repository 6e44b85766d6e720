"""accel.costmodel.planner / plans / megatron_table: memory predictions against the bytes this
course counts (chapters 04, 09, 11, 15), the arithmetic against hand counts and the published
formulas (Korthikanti et al. 2022's Table 2, Megatron Core's bytes per parameter), the options
(selective recomputation, sequence parallelism, interleaving, overlap) by hand, the ranking
against literal tables, the rule of thumb, Tables 1 and 2 of Narayanan et al. 2021, the
no-fit hints against the model itself, and bad input."""

import dataclasses
import math

import numpy as np
import pytest

from accel.costmodel import megatron_table as mt
from accel.costmodel import planner as pl
from accel.costmodel import plans
from accel.costmodel.transformer import layer_activation_bytes
from accel.costmodel.zero import zero_bytes_per_device, zero_comm_bytes_accumulated

A100 = pl.Cluster.dgx_a100(nodes=2)  # 16 GPUs
GPT_7B = pl.Transformer(layers=36, hidden=4096, heads=32, seq=2048, vocab=51200)
BLOCK = 4 * 24 * 2048 * 4096**2 * (1 + 2048 / (6 * 4096))  # one block, 4 passes, b = 1
LOGIT = 6 * 2048 * 4096 * 51200


# --- (1) the course's own counted bytes -------------------------------------------------------

def test_states_equal_chapter_04_estimate():
    from accel import models
    from accel.memory.estimate import estimate_training_memory

    model = models.keras_mlp([32, 64, 64, 10])
    est = estimate_training_memory(model, "adam")
    w, g, o = pl.state_bytes(model.count_params(), "fp32")
    assert (w, g, o) == (est.weights, est.gradients, est.optimizer_slots)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_layer_parameters_equal_chapter_11_shards(t):
    from accel.parallel import megatron

    shards = megatron.shard(megatron.init_block(hidden=16, heads=4), t)
    for s in shards:  # every device holds as many
        assert sum(int(np.size(v)) for v in s.values()) == pl.layer_parameters(16, t)
    assert pl.state_bytes(pl.layer_parameters(16, t), "fp32")[0] == \
        4 * sum(v.size for v in shards[0].values())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_states_equal_chapter_15_zero_counted_bytes(four_devices, stage):
    from accel.models import mlp_init
    from accel.parallel.layers import dense, linear
    from accel.parallel.zero import ZeroStep
    from accel.training import squared_error

    params = mlp_init([8, 16, 4])  # 144 and 68 parameters per layer: split 4 ways, no padding
    held = ZeroStep(params, four_devices, stage, squared_error,
                    layer_fns=[dense, linear]).held_bytes()
    w, g, o = pl.state_bytes(144 + 68, "fp32", zero=stage, data=4)
    for row in held.values():
        assert (row["weights"], row["grads"], row["optimizer"]) == (w, g, o)


# --- bytes per parameter: an explicit choice ---------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["mixed", "fp32"])
def test_state_bytes_equal_the_zero_paper_formulas(stage, precision):
    # the same counts as accel.costmodel.zero (Rajbhandari et al.), written independently
    z = zero_bytes_per_device(7_000_000, 8, stage, precision)
    assert pl.state_bytes(7_000_000, precision, stage, 8) == pytest.approx(
        (z["weights"], z["grads"], z["optimizer"]))


def test_bytes_per_parameter_literal_table():
    # ZeRO paper 16; Megatron Core developer guide, "Distributed Optimizer": bf16 params with
    # fp32 grads 18 (6 + 12/d distributed), fp16 params and grads 20 (4 + 16/d), fp32 16 (8 + 8/d)
    assert {k: sum(v) for k, v in pl.STATE_BYTES.items()} == {
        "mixed": 16, "megatron-bf16": 18, "megatron-fp16": 20, "fp32": 16}
    d, n = 8, 1000
    for precision, whole, split in (("megatron-bf16", 6, 12), ("megatron-fp16", 4, 16),
                                    ("fp32", 8, 8)):
        assert sum(pl.state_bytes(n, precision, zero=1, data=d)) == pytest.approx(
            whole * n + split * n / d)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp_bytes_equal_zero_module_in_mixed_precision(stage):
    # 16-bit gradients and weights: the ZeRO module's count, per micro-batch where it applies
    assert pl.dp_bytes(10_000, 8, stage, 5, "mixed") == pytest.approx(
        zero_comm_bytes_accumulated(10_000, 8, stage, 5, "mixed"))


def test_dp_bytes_by_hand_with_fp32_gradients():
    # 18 bytes: fp32 gradients reduce-scattered (4 bytes), bf16 weights gathered (2 bytes)
    n, d = 1000, 4
    assert pl.dp_bytes(n, d, 0, 1, "megatron-bf16") == 2 * 3 / 4 * 4 * n  # all-reduce, fp32
    assert pl.dp_bytes(n, d, 1, 1, "megatron-bf16") == 3 / 4 * (4 + 2) * n
    assert pl.dp_bytes(n, d, 2, 3, "megatron-bf16") == 3 / 4 * (3 * 4 + 2) * n
    assert pl.dp_bytes(n, d, 3, 3, "megatron-bf16") == 3 * 3 / 4 * (4 + 2 * 2) * n


# --- activations: Korthikanti et al. 2022, Table 2 ---------------------------------------------

# the activation tests' layer: s, b, h, a, t = 512, 2, 1024, 16, 4
_ACT_MODEL = pl.Transformer(layers=4, hidden=1024, heads=16, seq=512, vocab=1000)


def _kept(t: int = 4, b: int = 2, **kw) -> float:
    """Bytes one layer keeps for the backward under ``Plan(1, t, 1, microbatch=b, **kw)``."""
    return pl.layer_activations(_ACT_MODEL, pl.Plan(1, t, 1, microbatch=b, **kw))[0]


def test_layer_activations_are_korthikanti_table_2():
    s, b, h, a, t = 512, 2, 1024, 16, 4
    sbh = s * b * h
    kept = _kept

    assert kept(recompute="none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert kept(recompute="none") == pytest.approx(layer_activation_bytes(b, s, h, a, t))
    assert kept(recompute="none", sequence_parallel=True) == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t)))
    assert kept(recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert kept(recompute="selective", sequence_parallel=True) == pytest.approx(34 * sbh / t)
    assert kept(recompute="full") == 2 * sbh
    assert kept(recompute="full", sequence_parallel=True) == 2 * sbh / t


def test_activations_by_hand():
    # no recomputation, t = 1: Korthikanti et al.'s per-layer figure x layers x the
    # micro-batches 1F1B keeps: min(p, m) = 2 with p = 2 and m = 64 / (8 * 1) = 8
    plan = pl.Plan(data=8, tensor=1, pipeline=2, recompute="none")
    mem = pl.memory_per_device(GPT_7B, plan, 64)
    per_layer = layer_activation_bytes(batch=1, seq=2048, hidden=4096, heads=32)
    assert mem.activations == pytest.approx(2 * 18 * per_layer)
    # with recomputation: 2 s b h bytes per layer and micro-batch, plus one layer's full set
    plan = pl.Plan(data=8, tensor=1, pipeline=2)
    mem = pl.memory_per_device(GPT_7B, plan, 64)
    assert mem.activations == pytest.approx(2 * 18 * 2 * 2048 * 4096 + per_layer)
    # ZeRO 3 over 8 replicas: 16 bytes per parameter / 8, mixed precision
    z3 = pl.memory_per_device(GPT_7B, pl.Plan(8, 1, 2, zero=3), 64)
    params = 18 * (12 * 4096**2 + 13 * 4096) + (51200 + 2048) * 4096
    assert z3.weights + z3.gradients + z3.optimizer == pytest.approx(16 * params / 8)
    # its working set: one block's weights gathered twice (running, prefetched) at 2 bytes and
    # its unsharded gradient at 2 bytes: 6 x (12 h^2 + 13 h) for one block on one GPU
    assert z3.working == 6 * (12 * 4096**2 + 13 * 4096)
    assert z3.total == pytest.approx(z3.weights + z3.gradients + z3.optimizer
                                     + z3.activations + z3.working)
    # split over a tensor group of 4: (12 h^2 + 7 h) / 4 + 6 h per GPU; nothing below ZeRO 3
    z3t = pl.memory_per_device(GPT_7B, pl.Plan(4, 4, 1, zero=3), 64)
    assert z3t.working == 6 * ((12 * 4096**2 + 7 * 4096) // 4 + 6 * 4096)
    assert pl.memory_per_device(GPT_7B, pl.Plan(8, 1, 2, zero=2), 64).working == 0
    assert pl.memory_per_device(GPT_7B, pl.Plan(1, 8, 2, zero=3), 8).working == 0


def test_interleaving_memory_by_hand():
    # v = 2 chunks, p = 2: the first stage keeps 1 + (p - 1) / (p v) = 1.25 times as much
    flat = pl.memory_per_device(GPT_7B, pl.Plan(8, 1, 2, recompute="none"), 64).activations
    v2 = pl.memory_per_device(GPT_7B, pl.Plan(8, 1, 2, recompute="none", interleave=2), 64)
    assert v2.activations == pytest.approx(1.25 * flat)


# --- the arithmetic by hand -------------------------------------------------------------------

def test_parameters_and_flops_by_hand():
    # eq. 2 gives the parameter counts of Table 1 (in billions, one decimal)
    for row in mt.TABLE1:
        model = pl.Transformer(row[3], row[2], row[1], 2048, 51200)
        assert model.parameters / 1e9 == pytest.approx(row[0], abs=0.051)
    # eq. 3, written as in the paper
    b, s, layers, h, v = 8, 2048, 36, 4096, 51200
    eq3 = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    assert pl.step_flops(GPT_7B, 8) == pytest.approx(eq3)
    no_recompute = 72 * b * s * layers * h**2 * (1 + s / (6 * h)) + 6 * b * s * h * v
    assert pl.step_flops(GPT_7B, 8, "none") == pytest.approx(no_recompute)
    # selective: attention's core forward again, its two 2 b s^2 h matmuls per layer
    assert pl.step_flops(GPT_7B, 8, "selective") == pytest.approx(
        no_recompute + layers * 4 * b * s * s * h)


def test_step_time_by_hand():
    # 16 data replicas, micro-batches of 1: m = 4; the all-reduce crosses nodes (25 GB/s)
    e = pl.step_time(GPT_7B, A100, pl.Plan(16, 1, 1), 64)
    compute = 4 * (36 * BLOCK + LOGIT) / (312e12 * 0.5)
    allreduce = 2 * 15 / 16 * GPT_7B.parameters * 2 / 25e9
    assert e.compute_s == pytest.approx(compute)
    assert e.data_s == pytest.approx(allreduce)
    assert e.step_s == pytest.approx(compute + allreduce)


def test_overlap_by_hand():
    # ZeRO 0 with overlap: the all-reduce hides behind the last micro-batch's backward, the
    # stage's time minus its forward (one pass of the blocks, a third of the logit layer)
    e = pl.step_time(GPT_7B, A100, pl.Plan(16, 1, 1, overlap=True), 64)
    stage = (36 * BLOCK + LOGIT) / 156e12
    forward = (36 * BLOCK / 4 + LOGIT / 3) / 156e12
    allreduce = 2 * 15 / 16 * GPT_7B.parameters * 2 / 25e9
    assert e.data_s == pytest.approx(max(0.0, allreduce - (stage - forward)))
    assert e.step_s == pytest.approx(4 * stage + e.data_s)
    # ZeRO 3 with overlap: hidden up to the compute of all micro-batches
    z3 = pl.step_time(GPT_7B, A100, pl.Plan(16, 1, 1, zero=3, overlap=True), 64)
    grad = GPT_7B.parameters * 2 * 15 / 16 / 25e9
    assert z3.data_s == pytest.approx(max(0.0, 12 * grad - 4 * stage))


def test_pipeline_and_tensor_terms_by_hand():
    # t = 8 inside a node (NVLink 300 GB/s), p = 2 across nodes, one replica: m = 64
    e = pl.step_time(GPT_7B, A100, pl.Plan(1, 8, 2), 64)
    act = 2048 * 4096 * 2
    tp_per_mb = 6 * 18 * (2 * 7 / 8 * act) / 300e9
    assert e.tensor_s == pytest.approx(64 * tp_per_mb)
    stage = (18 * BLOCK + LOGIT) / 8 / 156e12
    p2p = 2 * (act / 8) / 25e9
    assert e.bubble_s == pytest.approx(stage + tp_per_mb + p2p)
    assert e.step_s == pytest.approx(65 * (stage + tp_per_mb + p2p))
    # sequence parallelism: reduce-scatter + all-gather, the same bytes, the same time
    sp = pl.step_time(GPT_7B, A100, pl.Plan(1, 8, 2, sequence_parallel=True), 64)
    assert sp.step_s == pytest.approx(e.step_s)
    # selective recomputation: 4 collectives per layer instead of 6, and the core's FLOPs
    sel = pl.step_time(GPT_7B, A100, pl.Plan(1, 8, 2, recompute="selective"), 64)
    assert sel.tensor_s == pytest.approx(64 * tp_per_mb * 4 / 6)
    block_sel = BLOCK * 3 / 4 + 4 * 2048**2 * 4096
    assert sel.compute_s == pytest.approx(64 * (18 * block_sel + LOGIT) / 8 / 156e12)


def test_interleaving_by_hand():
    # v = 2: (v m + p - 1) slots of half a stage plus one boundary send: the bubble halves,
    # the sends double
    flat = pl.step_time(GPT_7B, A100, pl.Plan(1, 8, 2), 64)
    v2 = pl.step_time(GPT_7B, A100, pl.Plan(1, 8, 2, interleave=2), 64)
    act = 2048 * 4096 * 2
    p2p = 2 * (act / 8) / 25e9
    half = (flat.compute_s + flat.tensor_s) / 64 / 2
    assert v2.step_s == pytest.approx((2 * 64 + 1) * (half + p2p))
    assert v2.bubble_s == pytest.approx(half + p2p)
    assert v2.pipeline_p2p_s == pytest.approx((2 * 64 + 1) * p2p)
    # the idle share is (p - 1) / (v m + p - 1), chapter 10's formula
    assert v2.bubble_s / v2.step_s == pytest.approx(1 / (2 * 64 + 1))


def test_zero_with_a_pipeline_by_hand():
    # ZeRO 2-3 with p > 1 are candidates now; each stage shards its own parameters over the
    # d replicas and pays the per-micro-batch traffic: d = 4, t = 2, p = 2, m = 64 / 4 = 16
    cands = plans.candidate_plans(GPT_7B, A100, 64)
    assert {c.zero for c in cands if c.pipeline > 1 and c.data > 1} == {0, 1, 2, 3}
    plan = pl.Plan(4, 2, 2, zero=3)
    params = pl.stage_parameters(GPT_7B, plan)
    assert params == 18 * ((12 * 4096**2 + 7 * 4096) // 2 + 6 * 4096) + 51200 * 4096 // 2 + \
        2048 * 4096
    mem = pl.memory_per_device(GPT_7B, plan, 64)
    assert mem.weights + mem.gradients + mem.optimizer == pytest.approx(16 * params / 4)
    e = pl.step_time(GPT_7B, A100, plan, 64)
    # replicas spaced t = 2 apart: 4 x 2 = 8 GPUs, inside one node (300 GB/s)
    assert e.data_s == pytest.approx(16 * 3 * 3 / 4 * 2 * params / 300e9)


def test_zero_traffic_per_microbatch_by_hand():
    # 16 replicas, m = 64 / 16 = 4 micro-batches of 1: ZeRO 2 reduce-scatters 4 times and
    # gathers once, ZeRO 3 gathers twice and reduce-scatters once per micro-batch
    grad = GPT_7B.parameters * 2 * 15 / 16 / 25e9
    z2 = pl.step_time(GPT_7B, A100, pl.Plan(16, 1, 1, zero=2), 64)
    z3 = pl.step_time(GPT_7B, A100, pl.Plan(16, 1, 1, zero=3), 64)
    assert z2.data_s == pytest.approx(5 * grad)
    assert z3.data_s == pytest.approx(12 * grad)
    b4 = pl.step_time(GPT_7B, A100, pl.Plan(16, 1, 1, zero=3, microbatch=4), 64)
    assert b4.data_s == pytest.approx(3 * grad)


# --- the search and the ranking ------------------------------------------------------------------

def test_ranking_is_a_literal_table():
    rows = plans.rank_plans(GPT_7B, A100, 64)
    got = [(r.plan.data, r.plan.tensor, r.plan.pipeline, r.plan.zero, r.plan.microbatch,
            r.plan.recompute) for r in rows[:5]]
    assert got == [(4, 2, 2, 1, 1, "none"), (4, 2, 2, 0, 1, "none"), (2, 4, 2, 1, 1, "none"),
                   (2, 4, 2, 0, 1, "none"), (4, 4, 1, 1, 1, "none")]
    assert plans.distinct_layouts(rows)[:3] == [(2, 2), (4, 2), (4, 1)]
    # what does not fit in 80% of the 80 GB is left out: 16 bytes x 7.5e9 parameters on one GPU
    assert all(r.memory.total <= 0.8 * 80e9 for r in rows)
    assert (16, 1, 1, 0) not in [(r.plan.data, r.plan.tensor, r.plan.pipeline, r.plan.zero)
                                 for r in rows]
    # the whole 80 GB admits more plans; a budget outside (0, 1] is refused
    assert len(plans.rank_plans(GPT_7B, A100, 64, memory_budget=1.0)) > len(rows)
    with pytest.raises(ValueError, match=r"memory_budget must be in \(0, 1\], got 1.5"):
        plans.rank_plans(GPT_7B, A100, 64, memory_budget=1.5)


def test_candidates_respect_the_options():
    cands = plans.candidate_plans(GPT_7B, A100, 64, **plans.LATER)
    assert {c.microbatch for c in cands} == {1, 2, 4, 8}
    assert {c.recompute for c in cands} == {"none", "selective", "full"}
    # sequence parallelism only with a tensor group; chunks only with a pipeline, when the
    # layers split into p v chunks and the micro-batches into multiples of p (Megatron-LM)
    assert not [c for c in cands if c.sequence_parallel and c.tensor == 1]
    for c in cands:
        if c.interleave > 1:
            m = 64 // (c.data * c.microbatch)
            assert c.pipeline > 1 and 36 % (c.pipeline * c.interleave) == 0
            assert m % c.pipeline == 0
    # 36 layers: p v = 2 x 4 or 4 x 4 chunks do not split them, so v = 4 never comes up
    assert {c.interleave for c in cands} == {1, 2}
    # no tensor group straddles a node unevenly: t divides 8 or is a multiple of 8
    assert {c.tensor for c in cands} == {1, 2, 4, 8, 16}


def test_rule_layouts_order_by_hand():
    # Takeaways #1-2: p = 1 up to a node's 8 GPUs, then t = 8 with the smallest p; the rest after
    layouts = [(4, 2), (8, 4), (2, 1), (8, 1), (16, 1), (8, 2), (1, 8)]
    assert plans.rule_layouts(layouts, 8) == [(2, 1), (8, 1), (8, 2), (8, 4), (4, 2), (1, 8),
                                              (16, 1)]
    with pytest.raises(ValueError, match="gpus_per_node must be an int >= 1, got 0"):
        plans.rule_layouts(layouts, 0)


# --- (2) Narayanan et al. 2021, Tables 1 and 2 ---------------------------------------------------

def test_megatron_table_1():
    rows = mt.compare()
    s = mt.summary(rows)
    assert [r["rank"] for r in rows] == [1, 1, 1, 3, 1, 1, 1, 2, 2, 1]
    assert [r["rule_rank"] for r in rows] == [1, 2, 2, 1, 1, 1, 1, 2, 2, 1]
    assert [r["layouts"] for r in rows] == [15, 12, 17, 14, 24, 3, 24, 22, 5, 7]
    assert [r["fitted"] for r in rows] == [True] * 3 + [False] * 7
    assert s["rows"] == 7 and s["in_top"] == 7 and s["missed"] == []
    # on the held-out rows the rule of thumb puts the published layout first as often or more
    assert (s["first"], s["rule_first"]) == (4, 5)
    # on throughput the trivial baseline (fitted on the same three rows) does as well
    assert s["within"] == s["trivial_within"] == 7
    assert s["trivial_median_abs_error"] < s["median_abs_error"] < 0.15
    assert 0.4 < mt.fit_utilization("trivial") < mt.fit_utilization() < 0.6
    assert mt.fit_utilization("trivial") == pytest.approx((137 * 138 * 142) ** (1 / 3) / 312)


def test_rule_first_equals_its_definition():
    # the rule's first layout for each row, by hand: among the layouts that fit, p = 1 with the
    # smallest t <= 8 if any fits, else t = 8 with the smallest p
    for row, r in zip(mt.TABLE1, mt.compare(), strict=True):
        _, heads, hidden, layers, _, _, gpus, batch, _ = row
        model = pl.Transformer(layers, hidden, heads, mt.SEQ, mt.VOCAB)
        cluster = pl.Cluster.dgx_a100(nodes=1, gpus=gpus)
        fit = plans.distinct_layouts(plans.rank_plans(model, cluster, batch, zero_stages=(0,),
                                                      recompute=("full",)))
        flat = sorted(t for t, p in fit if p == 1 and t <= 8)
        assert r["rule_first"] == ((flat[0], 1) if flat else
                                   (8, min(p for t, p in fit if t == 8)))
        assert r["layouts"] == len(fit)


def test_megatron_table_2_out_of_sample():
    rows = mt.compare_table2()
    zero3 = [r for r in rows if r["scheme"] == "ZeRO-3"]
    assert [r["gpus"] for r in zero3] == [384, 768, 1536, 640, 1120, 2240]
    # the published ZeRO-3 throughput lies between the no-overlap and full-overlap bounds, or
    # (micro-batches of one, the most GPUs) just under them, at nominal link bandwidth
    assert [r["within_bounds"] for r in zero3] == [True, True, False, True, True, False]
    for r in (zero3[2], zero3[5]):
        assert r["published_tflops"] < r["slow_tflops"] < 1.2 * r["published_tflops"]
    # where ZeRO-3 is communication-bound (768, 1536 GPUs) the planner puts PTD-P ahead, as
    # published; the trivial baseline gives both schemes the same figure
    ptdp = {r["gpus"]: r for r in rows if r["scheme"] == "PTD-P" and r["params_b"] == 174.6}
    for r in zero3[1:3]:
        assert r["slow_tflops"] < ptdp[r["gpus"]]["slow_tflops"]
        assert r["trivial_tflops"] == ptdp[r["gpus"]]["trivial_tflops"]


# --- a model that fits no plan: every hint tested in the model -----------------------------------

def test_no_fit_hints_are_the_model_applied():
    gpt3 = pl.Transformer(96, 12288, 96, 2048, 51200)
    with pytest.raises(ValueError) as err:
        plans.rank_plans(gpt3, A100, 512, zero_stages=(0, 1), recompute=("none",))
    text = str(err.value)
    base = {"zero_stages": (0, 1), "microbatch_sizes": plans.MICROBATCH_SIZES,
            "recompute": ("none",), "sequence_parallel": (False,), "interleave": (1,),
            "overlap": (False,)}

    def least(cluster, **change):
        search = dict(base, **change)
        return min((pl.memory_per_device(gpt3, p, 512).total
                    for p in plans.candidate_plans(gpt3, cluster, 512, **search)),
                   default=math.inf) / 1e9

    # each printed figure is the least memory with that option added, recomputed here
    assert f"with recompute='full': least {least(A100, recompute=('none', 'full')):.1f} GB" \
        in text
    assert f"with zero_stages=3: least {least(A100, zero_stages=(0, 1, 3)):.1f} GB" in text
    assert f"with sequence_parallel=True: least " \
           f"{least(A100, sequence_parallel=(False, True)):.1f} GB" in text
    # none closes the gap, not even all at once: then what would
    assert "-- fits" not in text
    assert f"with attention='fused': least " \
           f"{least(A100, attention=pl.ATTENTION):.1f} GB" in text
    every = dict(zero_stages=(0, 1, 2, 3), recompute=pl.RECOMPUTE,
                 sequence_parallel=(False, True), attention=pl.ATTENTION)
    assert least(A100, **every) > 64
    assert f"every option at once: least {least(A100, **every):.1f} GB" in text
    # the fewest nodes: 3-5 have no plan that fits (5 nodes: none splits batch 512), 6 do
    for n in (3, 4, 5):
        assert least(dataclasses.replace(A100, nodes=n), **every) > 64
    assert least(dataclasses.replace(A100, nodes=6), **every) <= 64
    assert "more GPUs: 6 nodes (48 GPUs)" in text
    # ZeRO-Offload (Ren et al. 2021, section 4): fp32 weights, Adam's moments and the 16-bit
    # gradients on the host, 12 + 2 = 14 bytes x 174.6e9 parameters = 2.44 TB, 1.22 TB per node
    # of a DGX A100's 2 TB; each GPU keeps its 16-bit weights and activations
    assert f"host 14 B/param, {14 * gpt3.parameters / 1e12:.2f} TB " \
           f"({7 * gpt3.parameters / 1e12:.2f} TB per node, within the node's 2.0 TB)" in text
    on_gpu = min(m.weights + m.activations + m.working for m in (
        pl.memory_per_device(gpt3, p, 512) for p in plans.candidate_plans(gpt3, A100, 512, **every,
        microbatch_sizes=plans.MICROBATCH_SIZES, interleave=(1,), overlap=(False,))))
    assert f"least {on_gpu / 1e9:.1f} GB per GPU; host" in text


def test_a_hint_that_closes_the_gap_is_marked():
    # 22B on one node, no recomputation, micro-batches of 8: full recomputation closes the gap,
    # and so do micro-batches of 1; ZeRO does not (one replica); then nothing more is said
    one = pl.Cluster.dgx_a100(nodes=1)
    model = pl.Transformer(48, 6144, 48, 2048, 51200)
    with pytest.raises(ValueError) as err:
        plans.rank_plans(model, one, 64, zero_stages=(0,), recompute=("none",),
                         microbatch_sizes=(8,))
    text = str(err.value)
    least = min(pl.memory_per_device(model, p, 64).total for p in plans.candidate_plans(
        model, one, 64, zero_stages=(0,), recompute=("none", "full"), microbatch_sizes=(8,)))
    assert least <= 64e9
    assert f"with recompute='full': least {least / 1e9:.1f} GB -- fits" in text
    assert "with microbatch_sizes=1: least" in text and "with zero_stages=3: least" in text
    assert text.count("-- fits") == 2 and "what would" not in text


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: pl.step_time(GPT_7B, A100, pl.Plan(3, 2, 2), 64),
     r"plan data=3 x tensor=2 x pipeline=2 = 12 GPUs, but the cluster has 16"),
    (lambda: pl.Transformer(0, 4096, 32, 2048, 51200), "layers must be an int >= 1, got 0"),
    (lambda: pl.Transformer(2, 4096, 30, 2048, 51200), "hidden=4096 is not divisible by heads=30"),
    (lambda: pl.Cluster(8, 2, -1.0, 1e12, 1e9, 1e9), "memory_bytes must be a number > 0, got -1"),
    (lambda: pl.Plan(data=0, tensor=1, pipeline=1), "data must be an int >= 1, got 0"),
    (lambda: pl.Plan(1, 1, 1, zero=4), r"zero must be one of \[0, 1, 2, 3\], got 4"),
    (lambda: pl.Plan(1, 1, 1, recompute=True),
     r"recompute must be one of \['none', 'selective', 'full'\], got True"),
    (lambda: pl.Plan(1, 1, 1, sequence_parallel=True), "it needs tensor > 1, got tensor=1"),
    (lambda: pl.Plan(1, 2, 1, interleave=2), "interleave=2 chunks need a pipeline"),
    (lambda: pl.Plan(1, 2, 2, overlap=1), "overlap must be True or False, got 1"),
    (lambda: pl.step_time(GPT_7B, A100, pl.Plan(4, 2, 2, interleave=4), 64),
     r"interleave=4 x pipeline=2 chunks do not split 36 layers evenly"),
    (lambda: pl.step_time(GPT_7B, A100, pl.Plan(4, 2, 2, microbatch=4, interleave=2), 16),
     r"interleave=2 needs the micro-batches \(1\) to be a multiple of pipeline=2"),
    (lambda: pl.memory_per_device(GPT_7B, pl.Plan(16, 1, 1), 40),
     r"batch=40 does not split into data=16 replicas .* multiple of 16"),
    (lambda: pl.step_time(GPT_7B, A100, pl.Plan(1, 16, 1), 64, utilization=0),
     r"utilization must be in \(0, 1\], got 0"),
    (lambda: pl.state_bytes(10, "bf16"), r"precision must be one of .*'megatron-bf16'"),
    (lambda: pl.Cluster.dgx_a100(nodes=1, gpus=12), "gpus=12 is not a multiple of 8"),
    (lambda: pl.stage_state_bytes([10, 20], [1, 2]), r"balance \[1, 2\] covers 3 layers"),
    (lambda: plans.candidate_plans(GPT_7B, A100, 64, recompute=(True,)),
     r"recompute must be one of .*, got True"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_plan_label():
    assert pl.Plan(8, 4, 2, 1, 1, "selective", True, 2, True).label == \
        "d8 t4 p2 ZeRO 1 b1 recompute selective, sp, v2, overlap"
    assert math.isclose(pl.Plan(8, 4, 2).gpus, 64)


# --- fused attention (FlashAttention: Dao et al. 2022, section 3.1) ----------------------------

def test_fused_attention_by_hand():
    s, b, h, a, t = 512, 2, 1024, 16, 4
    sbh = s * b * h
    kept = _kept

    # the 5 a s^2 b / t score bytes become an fp32 log-sum-exp per head and token: 4 a s b / t
    lse = 4 * a * s * b / t
    assert kept(recompute="none", attention="fused") == pytest.approx(sbh * (10 + 24 / t) + lse)
    assert kept(recompute="selective", attention="fused") == pytest.approx(
        sbh * (10 + 24 / t) + lse)
    assert kept(recompute="none", sequence_parallel=True, attention="fused") == pytest.approx(
        34 * sbh / t + lse)
    assert kept(recompute="full", attention="fused") == 2 * sbh
    # FLOPs: selective recomputation reruns nothing; the kernel's own recompute of S = Q K^T is
    # not charged (nor is materialized attention's memory traffic): same time as no recompute
    bb, ss, layers, hh, v = 8, 2048, 36, 4096, 51200
    none = 72 * bb * ss * layers * hh**2 * (1 + ss / (6 * hh)) + 6 * bb * ss * hh * v
    assert pl.step_flops(GPT_7B, 8, "none", "fused") == pytest.approx(none)
    assert pl.step_flops(GPT_7B, 8, "selective", "fused") == pytest.approx(none)
    assert pl.step_flops(GPT_7B, 8, "full", "fused") == pl.step_flops(GPT_7B, 8)
    sel = pl.Plan(16, 1, 1, recompute="selective")
    fused = pl.step_time(GPT_7B, A100, dataclasses.replace(sel, attention="fused"), 64)
    assert fused.step_s == pytest.approx(
        pl.step_time(GPT_7B, A100, pl.Plan(16, 1, 1, recompute="none"), 64).step_s)
    assert pl.step_time(GPT_7B, A100, sel, 64).step_s > fused.step_s
    assert "fused attention" in pl.Plan(8, 4, 2, attention="fused").label
    with pytest.raises(ValueError, match="attention must be one of"):
        pl.Plan(8, 4, 2, attention="flash")
    with pytest.raises(ValueError, match="attention"):
        plans.candidate_plans(GPT_7B, A100, 64, attention=("flash",))
    both = plans.candidate_plans(GPT_7B, A100, 64, attention=("materialized", "fused"))
    assert len(both) == 2 * len(plans.candidate_plans(GPT_7B, A100, 64))
