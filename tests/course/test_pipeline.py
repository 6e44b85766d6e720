"""Chapter 10's experiments (accel.course.pipeline): the exercises' checks, the stage builders'
errors."""

import pytest

from accel.course.pipeline import (
    check_exercise,
    count_messages,
    dependency_check,
    device_peak_stash,
    format_timeline,
    handoff_gaps,
    make_batch,
    measure_bubble,
    measure_waiting_bubble,
    overhead_report,
    overlap_share,
    replay_idle,
    square_stages,
    waiting_stages,
)
from accel.parallel import pipeline as pl
from accel.parallel import pipeline_exec as pe
from accel.training import squared_error


def test_chapter_10_exercise_solutions():
    for n in (1, 2, 3, 4):
        assert check_exercise(n, None) == f"exercise {n}: not answered yet"
        assert check_exercise(n, ...) == f"exercise {n}: not answered yet"
    # ZB-H1 with W = 2: each stage works 16 * (1 + 1 + 2) = 64 ticks and idles p - 1 = 3;
    # 1F1B (F = 1, B = 2): 3 (m + p - 1) = 57 ticks
    assert check_exercise(1, 67 / 57) == "exercise 1: correct"
    assert check_exercise(1, 0.89).startswith("exercise 1: not quite")  # W = 1: 51 / 57
    # three ways to fit m = 16 in room for 5 micro-batches' activations (F = 1, B = 2,
    # p = 4; recomputing keeps 16 inputs, a quarter each, plus 1 rebuilt), each flush taking
    # (m + p - 1)(F + B) ticks: 1F1B 19 * 3 = 57; GPipe recomputing (B = 3) 19 * 4 = 76; four
    # GPipe flushes of 4: 4 * 7 * 3 = 84. The slowest over the fastest: 84 / 57
    assert check_exercise(2, 84 / 57) == "exercise 2: correct"
    assert check_exercise(2, 4 / 3).startswith("exercise 2: not quite")  # recompute vs 1F1B
    assert check_exercise(2, 1.0).startswith("exercise 2: not quite")
    assert check_exercise(2, "4/3") == "exercise 2: give a number"
    # interleaved 1F1B, p = 4, v = 2: warm-up 2(p - d - 1) + (v - 1)p forwards (Megatron-LM,
    # forward_backward_pipelining_with_interleaving), then the steady state's first forward
    assert check_exercise(3, [2 * (4 - d - 1) + 4 + 1 for d in range(4)]) == "exercise 3: correct"
    assert check_exercise(3, [11, 9, 7, 5]) == "exercise 3: correct"
    assert check_exercise(3, [10, 8, 6, 4]).startswith("exercise 3: not quite")
    assert check_exercise(3, 11) == "exercise 3: give a list of four whole numbers, device 0 first"
    assert check_exercise(4, 8) == "exercise 4: correct"      # the next multiple of p = 4
    assert check_exercise(4, 6).startswith("exercise 4: not quite")


def test_interleaved_needs_a_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of num_stages"):
        pl.interleaved_orders(6, 4, 2)
    assert len(pl.interleaved_orders(8, 4, 2)) == 4


def test_format_timeline_matches_the_clock_for_unit_tasks():
    # with every task one tick, simulate places the orders as clock_schedule does: the text
    # must be format_schedule's
    logs = pl.simulate(pl.one_f_one_b_orders(4, 2), lambda task: 1)
    assert format_timeline(logs) == pl.format_schedule(pl.one_f_one_b_schedule(4, 2), 2)
    two = pl.simulate([[(0, 0, "F"), (0, 0, "B")]], lambda t: 2 if t[2] == "B" else 1)
    assert format_timeline(two, "t").splitlines() == ["t", "tick     0  1  2",
                                                      "stage 0 F0 B0 B0"]
    with pytest.raises(ValueError, match="whole ticks"):
        format_timeline(pl.simulate([[(0, 0, "F")]], lambda t: 0.5))
    with pytest.raises(ValueError, match="no task"):
        format_timeline([[]])


def test_measure_bubble_one_clock(four_devices):
    # at m = 1 the three sides run the same work; each is one run_schedule call; busy times
    # are sums of logged task durations, so never above the wall time times the devices
    r = measure_bubble(four_devices[:2], microbatches=(1, 2), balance=(1, 1), width=8,
                       microbatch=4, repeat=1, schedule="zb-h1", baselines=(1,))
    assert r[1]["formula"] is None and r[2]["formula"] == pytest.approx(1 / 7)
    assert r[2]["one_device_s"] is None and set(r[2]["task_s"]) == {"F", "B", "W"}
    one = r[1]
    # every figure of a row comes from the one run it returns
    assert one["measured"] == [float(v) for v in pe.measured_idle_fractions(one["run"])]
    assert one["peak_stash"] == one["run"].peak_stash
    assert one["busy_s"] <= 2 * one["step_s"] and one["one_busy_s"] <= one["one_device_s"]
    with pytest.raises(ValueError, match="schedule"):
        measure_bubble(four_devices[:2], microbatches=(1,), schedule="interleaved")


def test_messages_and_recorded_dependencies(four_devices):
    assert count_messages(pl.one_f_one_b_schedule(8, 2), 2) == 16
    assert count_messages(pl.interleaved_schedule(8, 2, 2), 2, 4) == 48
    stages = square_stages(four_devices[:2], [1, 1], width=8, traced=True)
    run = pe.run_schedule(stages, pl.gpipe_schedule(4, 2), *make_batch(4, 4, 8),
                          squared_error, 4)
    assert dependency_check(run, 2) == (2 * 4, 0)  # 4 forwards and 4 backwards cross
    assert len(handoff_gaps(run, 2)) == 15 and len(replay_idle(run)) == 2
    assert 0.0 <= overlap_share(run) <= 1.0


def test_waiting_stages_carry_the_batch_and_its_gradient(four_devices):
    """The waiting stages compute x @ I @ I: the loss is the mean of x^2 over its 8 x 4 entries
    (y = 0), and each stage's dL/dw = x^T 2x / 32 (w = I on both stages), by hand."""
    import numpy as np
    import tensorflow as tf

    stages = waiting_stages(four_devices[:2], forward_ms=0.1)
    x = tf.constant(np.arange(32, dtype=np.float32).reshape(8, 4) / 32)
    y = tf.zeros((8, 4))
    run = pe.run_schedule(stages, pl.make_schedule("1f1b", 2, 2), x, y, squared_error, 2)
    np.testing.assert_allclose(run.loss, np.mean(x.numpy() ** 2), rtol=1e-6)
    by_hand = x.numpy().T @ (2 * x.numpy()) / 32
    for grads in run.grads:
        np.testing.assert_allclose(grads[0].numpy(), by_hand, rtol=1e-5)
    rows = measure_waiting_bubble(four_devices[:2], microbatches=(2,), forward_ms=0.1, repeat=1)
    assert {k: v[2]["formula"] for k, v in rows.items()} == pytest.approx(
        {"1f1b v=1": 1 / 3, "interleaved v=2": 1 / 5})  # (p-1)/(vm+p-1), p = 2, m = 2


def test_square_stages_need_a_device_each(four_devices):
    with pytest.raises(ValueError, match="2 stages need 2 devices, got 1"):
        square_stages(four_devices[:1], [1, 1])


def test_overhead_report_by_hand():
    # fit 10 ms a step; 1F1B at p = 2, m = 4 is 26 ms: 16 tasks share the extra 16 ms (1 ms
    # each); interleaved v = 2 at 42 ms: 32 tasks share 32 ms; the one-device run's 16 tasks
    # share 8 ms, as do recomputing 1F1B's at 18 ms
    steps = {"keras fit": 0.010, "pipeline p=1 m=1": 0.012, "pipeline p=2 m=4 1F1B": 0.026,
             "pipeline p=2 m=4 1F1B, recompute": 0.018,
             "pipeline p=2 m=4 interleaved v=2": 0.042, "2 stages on 1 device, m=4": 0.018}
    report = overhead_report(steps)
    assert report["ratio"]["pipeline p=1 m=1"] == pytest.approx(1.2)
    assert report["per_task_s"] == pytest.approx({"pipeline p=2 m=4 1F1B": 0.001,
                                                  "pipeline p=2 m=4 1F1B, recompute": 0.0005,
                                                  "pipeline p=2 m=4 interleaved v=2": 0.001,
                                                  "2 stages on 1 device, m=4": 0.0005})


def test_device_peak_stash_by_hand():
    # interleaved, m = 4, p = 2, v = 2 (the chapter's drawing): device 0 runs F0c0 F1c0 F0c1
    # F1c1 (4 chunks held), then F2c0 (5), B0c1 (4), F3c0 (5), ...: at most 5 half-stages;
    # device 1 runs F0c0 F1c0 F0c1 (3), B0c1 (2), F1c1 (3), B1c1 (2), ...: at most 3
    assert device_peak_stash(pl.interleaved_schedule(4, 2, 2), 4, 2) == [2.5, 1.5]
    for sched, p in [(pl.one_f_one_b_schedule(8, 4), 4), (pl.gpipe_schedule(6, 3), 3),
                     (pl.zb_h1_schedule(6, 3), 3)]:
        assert device_peak_stash(sched, p, p) == pl.peak_in_flight(sched, p)
    with pytest.raises(ValueError, match="multiple"):
        device_peak_stash(pl.one_f_one_b_schedule(4, 3), 3, 2)


def test_task_times_leave_out_forwards_run_inside_their_backward():
    """A written log: stage 1 ran micro-batch 0's forward inside its backward (an F of 0.1, a
    B of 5), so the medians are stage 0's own (F 2, B 3), the pair's only when every
    micro-batch's forward was deferred."""
    from accel.course.pipeline import _task_times

    log = [[((0, 0, "F"), 0.0, 2.0), ((0, 0, "B"), 7.1, 10.1)],
           [((1, 0, "F"), 2.0, 2.1), ((1, 0, "B"), 2.1, 7.1)]]
    assert _task_times(pe.PipelineRun(0.0, [], log=log, deferred={(1, 0)})) == {"F": 2.0,
                                                                                 "B": 3.0}
    one = pe.PipelineRun(0.0, [], log=log[1:], deferred={(1, 0)})
    assert _task_times(one) == pytest.approx({"F": 0.1, "B": 5.0})
