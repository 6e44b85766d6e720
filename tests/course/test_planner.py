"""accel.course.planner: the planner's bytes equal the chapters' counted bytes; the exercises'
solutions; the figure draws from the cost model."""

import pytest

from accel.costmodel import plans
from accel.course import planner as course


def test_memory_checks_are_equal(four_devices):
    checks = course.memory_checks(four_devices)
    assert len(checks) == 9
    for name, (predicted, counted) in checks.items():
        assert predicted == counted, name
    # chapter 09's first device: 8x16+16 and 16x16+16 float32 weights; chapter 04's MLP: its
    # weights, the tape's gradients and Adam's moments, 4 + 4 + 8 bytes per parameter
    mlp = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    assert checks["ch04 MLP, Adam: weights + grads + moments"][1] == 16 * mlp
    assert checks["ch09 split, CPU:0: weights"][1] == 4 * (8 * 16 + 16 + 16 * 16 + 16)


def test_keras_block_bytes_on_a_device(four_devices):
    # a real Keras block on CPU:1: its variables, gradients and Adam's moments equal the
    # planner's bytes; its kept activations (an unfused GELU's intermediates, no dropout)
    # differ from Korthikanti et al.'s Megatron count, which the chapter prints
    rows = course.keras_block_check(four_devices[1], hidden=16, heads=2, seq=8, batch=2,
                                    peak=False)
    for name in ("weights (variables on the device)", "gradients", "Adam's moments"):
        assert rows[name][0] == rows[name][1] == {"gradients": 1, "Adam's moments": 2}.get(
            name, 1) * 4 * (12 * 16 * 16 + 13 * 16), name
    planner, kept = rows["activations kept for the backward"]
    assert 0.5 < kept / planner < 2


def test_exercise_solutions():
    # 1: with 18 bytes per parameter the 39.1B case's first layout moves from (4, 2) to (4, 4)
    name = "18 bytes per parameter"
    assert course.check_exercise(name, None) == f"exercise '{name}': not answered yet"
    assert course.exercise_answer(name) == (4, 4)
    assert course.check_exercise(name, (4, 4)) == f"exercise '{name}': correct"
    assert course.check_exercise(name, (4, 2)) == f"exercise '{name}': not quite, try again"
    assert course.check_exercise(name, "4, 4") == f"exercise '{name}': not quite, try again"
    # 2: the 18.4B row with the later options keeps (4, 2) ahead of the rule's (8, 1)
    name = "later options, 18.4B"
    assert course.exercise_answer(name) == (4, 2)
    assert course.check_exercise(name, [4, 2]) == f"exercise '{name}': correct"
    with pytest.raises(ValueError, match="exercise must be one of"):
        course.check_exercise("nope", (1, 1))


def test_exercise_three_benchmark_runs():
    # 3: the (t, p, ZeRO) layouts ranked first under any of the four assumptions: section 1's
    # layout without overlap (at either utilisation), section 3's with overlap at 0.5, and a
    # third, with a pipeline, with overlap at the best matmul's share (faster compute hides less)
    name = "three benchmark runs"
    answer = {(4, 2, 1), (2, 1, 2), (2, 2, 2)}
    assert course.check_exercise(name, None) == f"exercise '{name}': not answered yet"
    assert course.exercise_answer(name) == answer
    for given in (answer, [(2, 2, 2), (4, 2, 1), (2, 1, 2)], [[2, 1, 2], [2, 2, 2], [4, 2, 1]]):
        assert course.check_exercise(name, given) == f"exercise '{name}': correct"
    # the top three rows of one ranking, or the runners-up of section 3, are not the answer
    for wrong in ({(4, 2, 1)}, {(4, 2, 1), (2, 1, 2)}, {(4, 2, 1), (2, 1, 2), (4, 1, 2)},
                  (4, 2, 1), "(4, 2, 1), (2, 1, 2), (2, 2, 2)"):
        assert course.check_exercise(name, wrong) == f"exercise '{name}': not quite, try again"
    # independently: the best matmul's share from its literal figures (267.9 of 312 TFLOP/s)
    # and each ranking built here from plans.rank_plans' own arguments
    model, cluster, batch = course.CASES["39.1B on 8 DGX A100"]
    assert course.ASSUMPTIONS["no overlap, best matmul's share"]["utilization"] == \
        pytest.approx(267.9 / 312)
    firsts = set()
    for overlap in ((False,), (False, True)):
        for utilization in (0.5, 267.9 / 312):
            search = dict(plans.LATER, overlap=overlap)
            first = plans.rank_plans(model, cluster, batch, utilization=utilization,
                                     **search)[0].plan
            firsts.add((first.tensor, first.pipeline, first.zero))
    assert firsts == answer
    assert course.first_layouts()["overlap in full, utilisation 0.5"] == (2, 1, 2)
    # the exercises' answers still check as before: a set is no (t, p) pair
    assert course.check_exercise("18 bytes per parameter", {(4, 4)}).endswith("try again")
    with pytest.raises(ValueError, match="case must be one of"):
        course.first_layouts("nope")
    with pytest.raises(ValueError, match="assumptions must be a non-empty dict"):
        course.first_layouts(assumptions={})
    with pytest.raises(ValueError, match="must be a dict of rank_plans arguments"):
        course.first_layouts(assumptions={"x": 0.5})


def test_figure_terms_shows_the_fastest_layouts():
    fig = course.figure_terms(top=3)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    model, cluster, batch = course.CASES["39.1B on 8 DGX A100"]
    rows = plans.rank_plans(model, cluster, batch)
    assert labels[0] == f"d{rows[0].plan.data} t{rows[0].plan.tensor} p{rows[0].plan.pipeline}"
    assert labels == ["d8 t4 p2", "d4 t4 p4", "d8 t8 p1"]  # as in the table above it
    # the stacked bars add up to each plan's modelled step, the pipeline's sends included
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    assert names == ["compute", "tensor all-reduces", "bubble", "pipeline sends",
                     "data-parallel traffic"]
    picked = course.fastest_layouts(top=3)
    heights = [bar.get_y() + bar.get_height() for bar in ax.containers[-1]]
    assert heights == pytest.approx([r.time.step_s for r in picked])
    # the sends: v m of them, each 2 s b h / t bytes at 2 B over the network (25 GB/s)
    first = picked[0].plan
    sends = ax.containers[3][0].get_height()
    assert sends == pytest.approx(64 * 2 * 2 * 2048 * 8192 / first.tensor / 25e9)


def test_fastest_layouts_are_distinct_and_ranked():
    rows = course.fastest_layouts(top=4)
    keys = [(r.plan.data, r.plan.tensor, r.plan.pipeline) for r in rows]
    assert len(set(keys)) == 4
    assert [r.time.step_s for r in rows] == sorted(r.time.step_s for r in rows)
    # the compute differs between layouts: the last stage also runs the logit layer, so the
    # deeper pipeline (p = 4) computes longer per GPU than p = 2 and p = 1
    by_p = {r.plan.pipeline: r.time.compute_s for r in rows}
    assert by_p[1] < by_p[2] < by_p[4]
    with pytest.raises(ValueError, match="case must be one of"):
        course.fastest_layouts("nope")
