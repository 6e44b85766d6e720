"""Chapter 16's helpers: the alpha-beta arithmetic against hand counts, the balancing run's
claims (deterministic; the bias evens the load faster than the loss, both better than nothing),
and the exercises: "not answered yet" for the placeholders, "correct" for the solutions written
here, and not correct for wrong answers."""


import numpy as np
import pytest

from accel.course import experts as course
from accel.parallel import moe


def test_dispatch_rows_by_hand():
    rows = course.dispatch_rows()
    copies, width, hidden = 4096 * 8, 7168, 2048
    per_copy = width * (8.25 / 8 + 2)  # FP8 + one FP32 scale per 128 values, then BF16
    compute = copies * 6 * width * hidden / (0.5 * 989.4e12)
    assert [r["compute_s"] for r in rows] == pytest.approx([compute] * 3)
    # the same FLOPs at 50% of the H100's dense FP8 peak (1978.9 TFLOP/s): half the time
    assert [r["compute_fp8_s"] for r in rows] == pytest.approx(
        [4096 * 8 * 6 * 7168 * 2048 / (0.5 * 1978.9e12)] * 3)
    assert rows[0]["bytes"] == pytest.approx(copies * 7 / 8 * per_copy)
    assert rows[1]["bytes"] == pytest.approx(copies * 56 / 64 * per_copy)
    assert rows[2]["bytes"] == pytest.approx(4096 * 4 * per_copy)
    t0 = 2 * 7 * 5e-6 + copies * 7 / 8 * per_copy / 450e9
    t1 = 2 * 56 * 10e-6 + copies * 56 / 64 * per_copy / 50e9
    assert [rows[0]["time_s"], rows[1]["time_s"]] == pytest.approx([t0, t1])
    # what the chapter says: inside a node below the compute, across nodes above it
    assert rows[0]["time_s"] < compute < rows[2]["time_s"] < rows[1]["time_s"]


def test_nvl72_row_by_hand():
    r = course.nvl72_row()
    copies, width = 4096 * 8 * 63 / 64, 7168  # every other GPU of the 64 is on NVLink 5
    per_copy = width * (8.25 / 8 + 2)
    assert r["bytes"] == pytest.approx(copies * per_copy)
    assert r["time_s"] == pytest.approx(2 * 63 * 5e-6 + copies * per_copy / 900e9)
    assert r["compute_s"] == pytest.approx(4096 * 8 * 6 * width * 2048 / (0.5 * 2250e12))
    assert r["time_s"] < 2 * r["compute_fp8_s"]  # within a factor 2 of the compute
    with pytest.raises(ValueError, match="at most 72"):
        course.nvl72_row(gpus=128)


def test_one_hot_cost_by_hand():
    c = course.one_hot_cost(tokens=4096, k=8, capacity_factor=1.25, width=7168,
                            expert_hidden=2048)
    assert c["mask_entries"] == 1.25 * 8 * 4096**2
    # T x E x C mask times [T, d], twice, over E x C slots of 6 d h FLOPs: 2T / 3h
    assert c["ratio"] == pytest.approx(2 * 4096 / (3 * 2048))
    small = course.one_hot_cost(tokens=1024, k=8, capacity_factor=1.25, width=7168,
                                expert_hidden=2048)
    assert small["ratio"] == pytest.approx(c["ratio"] / 4)


def test_expert_memory_by_hand():
    per_expert = 3 * 7168 * 2048
    assert course.expert_memory(64) == 4 * 4 * per_expert * 16  # 4 layers x 4 experts
    assert course.expert_memory(8) == 4 * 32 * per_expert * 16
    assert course.expert_memory(8, shard_over=8) == 4 * 32 * per_expert * (4 + 12 / 8)
    with pytest.raises(ValueError, match="ep must divide"):
        course.expert_memory(7)


def test_small_problem_matches_its_inputs(four_devices):
    x, gate, experts = course.small_problem(four_devices)
    xi, gi, _ = course.problem_inputs()
    np.testing.assert_array_equal(x.numpy(), xi)
    np.testing.assert_array_equal(gate.numpy(), gi)
    assert [w1.device[-5:] for w1, _ in experts] == [d[-5:] for d in four_devices]


def test_balancing_run_is_deterministic_and_the_bias_balances_fastest():
    runs = {m: course.balancing_run(m, steps=30) for m in ("none", "aux", "bias")}
    again = course.balancing_run("bias", steps=30)
    np.testing.assert_array_equal(again["load"], runs["bias"]["load"])
    assert all((r["load"].sum(1) == 256 * 2).all() for r in runs.values())  # every choice
    late = {m: float(np.mean(r["load"][-10:].max(1) / r["load"][-10:].mean(1)))
            for m, r in runs.items()}
    assert late["bias"] < late["aux"] < late["none"]
    fig = course.figure_balance(runs)
    assert len(fig.axes[0].lines) == 4  # three runs and the line at 1


def test_placeholders_are_not_answered_yet():
    assert course.check_capacity(None) == "exercise 1: not answered yet"
    assert course.check_ib_bytes(None) == "exercise 2: not answered yet"
    assert course.check_bias_rate(None) == "exercise 3: not answered yet"


def test_exercise_1_solution(four_devices):
    best = course.capacity_answer()
    assert course.check_capacity(best).startswith("exercise 1: correct")
    assert "over the 5% budget" in course.check_capacity(round(best - 0.05, 2))
    assert "a smaller factor does too" in course.check_capacity(2.0)
    assert "not quite" in course.check_capacity("1.1")
    # one group of 64 tokens, counted by the chapter's layer with groups=1: 6 of 128 dropped at
    # 1.1, 7 at 1.05 (over 5% of 128 = 6.4); section 4's 4 groups of 16 need 1.15
    x, gate, experts = course.small_problem(four_devices)
    for factor in (1.0, 1.05, 1.1, 1.15, 1.25):
        _, rs = moe.moe_layer(x, gate, experts, k=2, capacity_factor=factor, groups=1)
        assert rs[0].dropped == course._dropped(factor)[0]
    assert best == 1.1 and course._dropped(1.1)[0] == 6 and course._dropped(1.05)[0] > 6.4
    assert course.capacity_answer(groups=4) == 1.15
    # other draws of the problem: one group never needs more than 4 groups, often less
    draws = course.capacity_draws()
    assert all(one <= four + 1e-9 for one, four in draws)
    assert sum(one < four - 1e-9 for one, four in draws) >= len(draws) // 2
    assert "smaller factor than 4 groups" in course.check_capacity(best)


def test_exercise_2_solution():
    # A: 4 all-to-alls x 2560 copies x 12/16 remote x 4096 x 2 bytes per micro-batch
    a = 4 * 1280 * 2 * 12 // 16 * 4096 * 2
    # B: 16 experts x 3 x 4096 x 1024 x 2 bytes of gradients, ring over 4 copies: 2 x 3/4 of it
    b = 2 * 3 * (16 * 3 * 4096 * 1024 * 2) // 4
    assert course.ib_bytes_per_gpu() == (a, b) == (62_914_560, 603_979_776)
    assert 9 * a < b < 10 * a and course.ib_bytes_answer() == 10  # B / A = 9.6: no tie
    assert course.check_ib_bytes(10).startswith("exercise 2: correct")
    assert "too few" in course.check_ib_bytes(9)
    assert "too many" in course.check_ib_bytes(11)
    assert "not quite" in course.check_ib_bytes(9.5)
    assert "not quite" in course.check_ib_bytes((1, 2))


def test_exercise_3_solution():
    runs = {rate: course.balancing_run("bias", rate=rate) for rate in (0.01, 0.001, 0.1)}
    assert course.check_bias_rate(("worse", "worse"), runs).startswith("exercise 3: correct")
    assert "not yet" in course.check_bias_rate(("better", "worse"), runs)
    assert "not quite" in course.check_bias_rate(("slower", "worse"), runs)
