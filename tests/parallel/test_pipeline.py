"""accel.parallel.pipeline: schedules against tables written out by hand, the bubble formula,
stash counts, validation. Pure Python: no TensorFlow is imported by the module."""

import pytest

from accel.costmodel.pipeline import stash_microbatches
from accel.parallel import pipeline as pl
from accel.procs import run_python

# GPipe, m = 4 micro-batches, p = 2 stages: forward of micro-batch i on stage j at tick i + j,
# then the backwards in reverse, last stage first.
GPIPE_4_2 = [
    [(0, 0, "F")],
    [(0, 1, "F"), (1, 0, "F")],
    [(0, 2, "F"), (1, 1, "F")],
    [(0, 3, "F"), (1, 2, "F")],
    [(1, 3, "F")],
    [(1, 3, "B")],
    [(0, 3, "B"), (1, 2, "B")],
    [(0, 2, "B"), (1, 1, "B")],
    [(0, 1, "B"), (1, 0, "B")],
    [(0, 0, "B")],
]

# 1F1B, m = 4, p = 2: stage 0 warms up with p - 0 - 1 = 1 extra forward, stage 1 with none.
ONE_F_ONE_B_4_2 = [
    [(0, 0, "F")],
    [(0, 1, "F"), (1, 0, "F")],
    [(1, 0, "B")],
    [(0, 0, "B"), (1, 1, "F")],
    [(0, 2, "F"), (1, 1, "B")],
    [(0, 1, "B"), (1, 2, "F")],
    [(0, 3, "F"), (1, 2, "B")],
    [(0, 2, "B"), (1, 3, "F")],
    [(1, 3, "B")],
    [(0, 3, "B")],
]

# 1F1B, m = 2, p = 3: more stages than micro-batches, warm-ups cut at m.
ONE_F_ONE_B_2_3 = [
    [(0, 0, "F")],
    [(0, 1, "F"), (1, 0, "F")],
    [(1, 1, "F"), (2, 0, "F")],
    [(2, 0, "B")],
    [(1, 0, "B"), (2, 1, "F")],
    [(0, 0, "B"), (2, 1, "B")],
    [(1, 1, "B")],
    [(0, 1, "B")],
]


def as_sets(schedule):
    return [sorted(tick) for tick in schedule]


def test_gpipe_against_the_table():
    assert as_sets(pl.gpipe_schedule(4, 2)) == as_sets(GPIPE_4_2)


def test_one_f_one_b_against_the_tables():
    assert as_sets(pl.one_f_one_b_schedule(4, 2)) == as_sets(ONE_F_ONE_B_4_2)
    assert as_sets(pl.one_f_one_b_schedule(2, 3)) == as_sets(ONE_F_ONE_B_2_3)


@pytest.mark.parametrize("m, p", [(1, 2), (4, 2), (8, 4), (3, 3), (16, 2), (2, 5)])
def test_forward_at_tick_i_plus_j_and_the_bubble_formula(m, p):
    gpipe = pl.gpipe_schedule(m, p)
    when = {task: t for t, tasks in enumerate(gpipe) for task in tasks}
    assert all(when[(j, i, "F")] == i + j for i in range(m) for j in range(p))
    for schedule in (gpipe, pl.one_f_one_b_schedule(m, p)):
        pl.validate_schedule(schedule, p, m)
        assert len(schedule) == 2 * (m + p - 1)
        assert pl.idle_fraction(schedule, p) == pytest.approx((p - 1) / (m + p - 1))
    assert pl.bubble_fraction(m, p) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("m, p", [(4, 2), (8, 4), (2, 3), (16, 4)])
def test_stash_gpipe_holds_m_and_1f1b_at_most_p(m, p):
    assert pl.peak_in_flight(pl.gpipe_schedule(m, p), p) == [m] * p
    assert pl.peak_in_flight(pl.one_f_one_b_schedule(m, p), p) == [min(p - j, m)
                                                                   for j in range(p)]


def test_stage_orders_and_text():
    orders = pl.stage_orders(pl.one_f_one_b_schedule(4, 2), 2)
    assert orders == pl.one_f_one_b_orders(4, 2)
    assert [f"{ph}{i}" for _, i, ph in orders[0]] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2",
                                                      "B3"]
    text = pl.format_schedule(GPIPE_4_2, 2).splitlines()
    assert text[1].split() == ["stage", "0", "F0", "F1", "F2", "F3", ".", ".", "B3", "B2", "B1",
                               "B0"]
    assert text[2].split()[2:] == [".", "F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0", "."]


def test_a_reader_schedule_runs_through_clock_schedule():
    """Any per-stage order works: all forwards first on stage 0, 1F1B on stage 1."""
    orders = [pl.gpipe_orders(3, 2)[0], pl.one_f_one_b_orders(3, 2)[1]]
    schedule = pl.clock_schedule(orders)
    pl.validate_schedule(schedule, 2, 3)
    assert pl.stage_orders(schedule, 2) == orders


@pytest.mark.parametrize("schedule, message", [
    ([[(0, 0, "B")], [(0, 0, "F")]], r"task \(0, 0, 'B'\) at tick 0 runs before \(0, 0, 'F'\)"),
    ([[(0, 0, "F")]], r"the schedule drops task \(0, 0, 'B'\)"),
    ([[(0, 0, "F")], [(0, 0, "F"), ]], r"task \(0, 0, 'F'\) runs twice"),
    ([[(0, 0, "F"), (0, 1, "F")]], "a stage runs two tasks at once"),
    ([[(2, 0, "F")]], r"\(2, 0, 'F'\) is not a \(stage < 1"),
    ([[(0, 0, "X")]], r"\(0, 0, 'X'\) is not a"),
])
def test_validate_names_the_problem(schedule, message):
    m = 2 if "two tasks" in message else 1
    with pytest.raises(ValueError, match=message):
        pl.validate_schedule(schedule, 1, m)


def test_bad_sizes_and_deadlocks():
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1, got 0"):
        pl.gpipe_schedule(0, 2)
    with pytest.raises(ValueError, match="num_stages must be an int >= 1, got -1"):
        pl.one_f_one_b_schedule(4, -1)
    with pytest.raises(ValueError, match="the stage orders deadlock at tick 0"):
        pl.clock_schedule([[(0, 0, "B"), (0, 0, "F")]])
    with pytest.raises(ValueError, match=r"device 0's order holds \(1, 0, 'F'\)"):
        pl.clock_schedule([[(1, 0, "F")]])
    with pytest.raises(ValueError, match=r"device 1's order holds \(2, 0, 'F'\).*"
                                         r"placed on device 1 \(stage % 2 == 1\)"):
        pl.clock_schedule([[(0, 0, "F")], [(2, 0, "F")]], num_stages=4)


def test_the_module_imports_no_tensorflow():
    out = run_python("import sys\nfrom accel.parallel import pipeline\n"
                     "print('tensorflow' in sys.modules)")
    assert out.strip() == "False"


def test_simulate_with_unit_times_is_the_clock_and_with_real_times_the_formula():
    orders = pl.one_f_one_b_orders(8, 4)
    logs = pl.simulate(orders, lambda task: 1.0)
    clock = pl.one_f_one_b_schedule(8, 4)
    when = {task: t for t, tasks in enumerate(clock) for task in tasks}
    assert all(start == when[task] for log in logs for task, start, _ in log)
    # backward twice as long as forward: the bubble is still (p-1)/(m+p-1) on every stage
    logs = pl.simulate(pl.gpipe_orders(8, 4), lambda task: 2.0 if task[2] == "B" else 1.0)
    assert pl.interval_idle_fractions(logs) == pytest.approx([3 / 11] * 4)
    # one stage twice as slow: the others wait for it, and its own idle share shrinks
    slow = pl.simulate(pl.gpipe_orders(8, 2), lambda task: 2.0 if task[0] == 1 else 1.0)
    idle = pl.interval_idle_fractions(slow)
    assert idle[1] < pl.bubble_fraction(8, 2) < idle[0]
    with pytest.raises(ValueError, match=r"durations\(\(0, 0, 'F'\)\) must be a number >= 0"):
        pl.simulate(pl.gpipe_orders(1, 1), lambda task: -1.0)


# ---------------------------------------------------------------------- interleaved 1F1B
def test_interleaved_orders_by_hand():
    """p = 2 devices, v = 2 chunks, m = 4: virtual stages 0 and 2 on device 0, 1 and 3 on
    device 1; forwards in groups of p micro-batches per chunk; Megatron's warm-up
    2 (p - d - 1) + (v - 1) p = 4 forwards on device 0, 2 on device 1."""
    orders = pl.interleaved_orders(4, 2, 2)
    assert orders[0] == [(0, 0, "F"), (0, 1, "F"), (2, 0, "F"), (2, 1, "F"),
                         (0, 2, "F"), (2, 0, "B"), (0, 3, "F"), (2, 1, "B"),
                         (2, 2, "F"), (0, 0, "B"), (2, 3, "F"), (0, 1, "B"),
                         (2, 2, "B"), (2, 3, "B"), (0, 2, "B"), (0, 3, "B")]
    assert orders[1] == [(1, 0, "F"), (1, 1, "F"), (3, 0, "F"), (3, 0, "B"),
                         (3, 1, "F"), (3, 1, "B"), (1, 2, "F"), (1, 0, "B"),
                         (1, 3, "F"), (1, 1, "B"), (3, 2, "F"), (3, 2, "B"),
                         (3, 3, "F"), (3, 3, "B"), (1, 2, "B"), (1, 3, "B")]


@pytest.mark.parametrize("m,p,v", [(2, 2, 2), (4, 2, 2), (8, 4, 2), (6, 3, 3), (8, 2, 3),
                                   (16, 4, 4)])
def test_interleaved_bubble_is_narayanan_formula(m, p, v):
    """Unit ticks: the idle share is (p-1)/(v m + p-1) (Narayanan et al. 2021, eq. for the
    interleaved schedule), below 1F1B's (p-1)/(m+p-1) at the same m."""
    schedule = pl.interleaved_schedule(m, p, v)
    pl.validate_schedule(schedule, p * v, m, num_devices=p)
    assert len(schedule) == 2 * v * m + 2 * (p - 1)
    assert pl.idle_fraction(schedule, p) == pytest.approx((p - 1) / (v * m + p - 1))
    assert pl.bubble_fraction(m, p, v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert pl.idle_fraction(schedule, p) < pl.idle_fraction(pl.one_f_one_b_schedule(m, p), p)
    # played out with backward twice the forward, the clock's order still never deadlocks
    logs = pl.simulate(pl.interleaved_orders(m, p, v),
                       lambda task: 2.0 if task[2] == "B" else 1.0, num_stages=p * v)
    assert [len(log) for log in logs] == [2 * m * v] * p


def test_interleaved_text_and_errors():
    text = pl.format_schedule(pl.interleaved_schedule(2, 2, 2), 4, num_devices=2)
    assert text.splitlines()[1].split()[:5] == ["device", "0", "F0c0", "F1c0", "F0c1"]
    with pytest.raises(ValueError, match="multiple of num_stages: got num_microbatches=3, "
                                         "num_stages=2"):
        pl.interleaved_schedule(3, 2, 2)
    with pytest.raises(ValueError, match="num_chunks must be an int >= 1, got 0"):
        pl.interleaved_orders(4, 2, 0)
    with pytest.raises(ValueError, match="a device runs two tasks at once"):
        pl.validate_schedule([[(0, 0, "F"), (2, 0, "F")]], 4, 1, num_devices=2)
    with pytest.raises(ValueError, match="5 stages do not spread evenly over 2 devices"):
        pl.validate_schedule([], 5, 1, num_devices=2)


def test_make_schedule_by_name():
    assert pl.make_schedule("gpipe", 4, 2) == pl.gpipe_schedule(4, 2)
    assert pl.make_schedule("1f1b", 4, 2) == pl.one_f_one_b_schedule(4, 2)
    assert pl.make_schedule("interleaved", 4, 2, 2) == pl.interleaved_schedule(4, 2, 2)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag': choose one of"):
        pl.make_schedule("zigzag", 4, 2)
    with pytest.raises(ValueError, match="num_chunks=2 needs the 'interleaved' schedule"):
        pl.make_schedule("1f1b", 4, 2, 2)


# ---------------------------------------------------------------------- ZB-H1 (B and W split)
# Qi et al. 2023 (arXiv:2401.10241), Figure 3 top: p = 4 workers, m = 8 micro-batches, F, B
# (input gradient) and W (weight gradient) one tick each; micro-batches counted from 0 here.
# Written out by hand, one row per stage and one column per tick, "." where the stage idles.
ZB_H1_8_4 = [
    "F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
    ".  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
    ".  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
    ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
]

# p = 2, m = 2 by hand: stage 1's B0 needs only F0 (the last stage), stage 0's B0 only stage
# 1's B0 (not its W0): 7 ticks, 2 of 14 device-ticks idle = (p-1)/(3m+p-1) = 1/7.
ZB_H1_2_2 = [
    [(0, 0, "F")],
    [(0, 1, "F"), (1, 0, "F")],
    [(1, 0, "B")],
    [(0, 0, "B"), (1, 1, "F")],
    [(0, 0, "W"), (1, 1, "B")],
    [(0, 1, "B"), (1, 0, "W")],
    [(0, 1, "W"), (1, 1, "W")],
]


def test_zb_h1_against_the_paper_figure():
    schedule = pl.zb_h1_schedule(8, 4)
    rows = [line.split()[2:] for line in pl.format_schedule(schedule, 4).splitlines()[1:]]
    assert rows == [row.split() for row in ZB_H1_8_4]
    assert pl.zb_h1_orders(8, 4) == [[(j, int(c[1:]), c[0]) for c in row.split() if c != "."]
                                     for j, row in enumerate(ZB_H1_8_4)]
    assert pl.stage_orders(schedule, 4) == pl.zb_h1_orders(8, 4)
    assert as_sets(pl.zb_h1_schedule(2, 2)) == as_sets(ZB_H1_2_2)
    assert pl.make_schedule("zb-h1", 8, 4) == schedule


@pytest.mark.parametrize("m, p", [(2, 2), (4, 2), (8, 4), (3, 3), (16, 4), (5, 3)])
def test_zb_h1_bubble_is_a_third_of_1f1b_with_its_peak_stash(m, p):
    """Unit ticks: 3m + p - 1 ticks, idle (p-1)/(3m+p-1); the bubble, p - 1 ticks per stage,
    is a third of 1F1B's on the same clock (1F1B's backward = B + W, two ticks: simulated).
    Every stage holds p micro-batches at its peak, 1F1B's first stage's peak."""
    schedule = pl.zb_h1_schedule(m, p)
    pl.validate_schedule(schedule, p, m)
    assert len(schedule) == 3 * m + p - 1
    assert pl.idle_fraction(schedule, p) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert pl.bubble_fraction(m, p, schedule="zb-h1") == pytest.approx((p - 1) / (3 * m + p - 1))
    one_f_one_b = pl.simulate(pl.one_f_one_b_orders(m, p),
                              lambda task: 2.0 if task[2] == "B" else 1.0)
    span = max(e for log in one_f_one_b for *_, e in log)
    assert span - 3 * m == 3 * (p - 1)  # 1F1B's bubble, per stage: three times ZB-H1's
    assert pl.peak_in_flight(schedule, p) == [p] * p
    assert max(pl.peak_in_flight(pl.one_f_one_b_schedule(m, p), p)) == p
    assert stash_microbatches("zb-h1", m, p) == stash_microbatches("1f1b", m, p) == p
    # simulate with unit times is the clock; with per-phase times (W cheaper), every task runs
    logs = pl.simulate(pl.zb_h1_orders(m, p), lambda task: 1.0)
    when = {task: t for t, tasks in enumerate(schedule) for task in tasks}
    assert all(start == when[task] for log in logs for task, start, _ in log)
    logs = pl.simulate(pl.zb_h1_orders(m, p), lambda t: {"F": 1.0, "B": 1.0, "W": 0.5}[t[2]])
    assert [len(log) for log in logs] == [3 * m] * p


def test_w_tasks_in_validation_dependencies_and_text():
    assert pl.dependencies((1, 2, "W"), 3) == [(1, 2, "B")]
    assert pl.dependencies((1, 2, "B"), 3) == [(1, 2, "F"), (2, 2, "B")]  # B, not W, of stage 2
    assert pl.splits_backward(ZB_H1_2_2) and not pl.splits_backward(ONE_F_ONE_B_4_2)
    without_w1 = [[t for t in tick if t != (1, 1, "W")] for tick in ZB_H1_2_2]
    with pytest.raises(ValueError, match=r"the schedule drops task \(1, 1, 'W'\)"):
        pl.validate_schedule(without_w1, 2, 2)
    early_w = [[(0, 0, "F")], [(0, 0, "W")], [(0, 0, "B")]]
    with pytest.raises(ValueError, match=r"task \(0, 0, 'W'\) at tick 1 runs before "
                                         r"\(0, 0, 'B'\)"):
        pl.validate_schedule(early_w, 1, 1)
    with pytest.raises(ValueError, match="the stage orders deadlock at tick 1"):
        pl.clock_schedule([[(0, 0, "F"), (0, 0, "W"), (0, 0, "B")]])
    # a micro-batch is held until its W: stage 0 of ZB-H1 (2, 2) holds both at tick 2
    assert pl.peak_in_flight(ZB_H1_2_2, 2) == [2, 2]
    assert pl.format_schedule(ZB_H1_2_2, 2).splitlines()[1].split()[2:] == [
        "F0", "F1", ".", "B0", "W0", "B1", "W1"]
    with pytest.raises(ValueError, match="the ZB-H1 formula holds for one chunk and "
                                         "num_microbatches >= num_stages"):
        pl.bubble_fraction(2, 4, schedule="zb-h1")
    with pytest.raises(ValueError, match="schedule must be one of"):
        pl.bubble_fraction(2, 4, schedule="zb-h2")


# ---------------------------------------------------------------------- ZB-V (V placement)
# Qi et al. 2023, section 6, with the authors' hand-built order (handcrafted_zb_v in
# sail-sg/zero-bubble-pipeline-parallelism; PyTorch's ScheduleZBVZeroBubble): p = 2 devices,
# 2p = 4 chunks placed as a V (device 0: stages 0 and 3, device 1: stages 1 and 2), m = 4;
# F, B, W of a chunk one tick each. Worked out by hand from the orders (device 0: 3 forwards of
# chunk 0, then F B W of chunk 1 twice, ...; device 1: F c0, F c1, F c0, F B W c1, ...) and the
# dependencies; "c1" is the device's second chunk (stage 3 on device 0, stage 2 on device 1).
ZB_V_4_2 = [
    "F0c0 F1c0 F2c0 F0c1 B0c1 W0c1 F1c1 B1c1 W1c1 F3c0 B0c0 W0c0 F2c1 B2c1 W2c1 B1c0 W1c0 "
    "F3c1 B3c1 W3c1 B2c0 W2c0 B3c0 W3c0 .",
    ". F0c0 F0c1 F1c0 F1c1 B0c1 W0c1 F2c0 B0c0 W0c0 F2c1 B1c1 W1c1 F3c0 B1c0 W1c0 F3c1 B2c1 "
    "W2c1 B2c0 B3c1 B3c0 W2c0 W3c1 W3c0",
]


def test_zb_v_against_the_table_written_by_hand():
    schedule = pl.zb_v_schedule(4, 2)
    text = pl.format_schedule(schedule, 4, num_devices=2, placement="v").splitlines()
    assert [line.split()[2:] for line in text[1:]] == [row.split() for row in ZB_V_4_2]
    stage = {(0, "c0"): 0, (0, "c1"): 3, (1, "c0"): 1, (1, "c1"): 2}  # the V, by hand
    by_hand = [[(stage[(d, c[-2:])], int(c[1:-2]), c[0]) for c in row.split() if c != "."]
               for d, row in enumerate(ZB_V_4_2)]
    assert pl.zb_v_orders(4, 2) == by_hand
    assert pl.device_orders(schedule, 2, placement="v") == by_hand
    pl.validate_schedule(schedule, 4, 4, num_devices=2, placement="v")
    # one "." on each row: 2 idle device-ticks of 2 x 25
    assert sum(row.split().count(".") for row in ZB_V_4_2) == 2
    assert pl.idle_fraction(schedule, 2) == pytest.approx(2 / 50)
    assert pl.make_schedule("zb-v", 4, 2) == pl.make_schedule("zb-v", 4, 2, 2) == schedule
    # device 0 holds 4 chunk activations at tick 3 (F0-F2 of chunk 0, F0 of chunk 1): 2 stages'
    assert pl.peak_in_flight(schedule, 4, num_devices=2, placement="v") == [4, 4]
    assert pl.peak_in_flight(schedule, 4) == [4, 3, 2, 1]  # per stage, down the model


@pytest.mark.parametrize("m, p", [(3, 2), (4, 2), (8, 4), (5, 3), (12, 3), (7, 4)])
def test_zb_v_bubble_chart_and_peak_memory(m, p):
    """Unit ticks, m >= 2p - 1: the clock is 6m + p - 1 ticks (p - 1 idle on every device);
    device d's k-th task runs at tick d + k, the authors' hand-built chart (their rows start
    after d empty slots and hold no other gap); each device holds 2p chunk activations at its
    peak, p whole stages': the peak of 1F1B's first stage."""
    schedule = pl.zb_v_schedule(m, p)
    pl.validate_schedule(schedule, 2 * p, m, num_devices=p, placement="v")
    assert len(schedule) == 6 * m + p - 1
    assert pl.idle_fraction(schedule, p) == pytest.approx((p - 1) / (6 * m + p - 1))
    assert pl.bubble_fraction(m, p, schedule="zb-v") == pytest.approx((p - 1) / (6 * m + p - 1))
    when = {task: t for t, tasks in enumerate(schedule) for task in tasks}
    for d, order in enumerate(pl.zb_v_orders(m, p)):
        assert [when[task] for task in order] == [d + k for k in range(6 * m)]
    peak = pl.peak_in_flight(schedule, 2 * p, num_devices=p, placement="v")
    assert [n / 2 for n in peak] == [p] * p == [max(pl.peak_in_flight(
        pl.one_f_one_b_schedule(m, p), p))] * p
    logs = pl.simulate(pl.zb_v_orders(m, p), lambda task: 1.0, num_stages=2 * p)
    assert all(start == when[task] for log in logs for task, start, _ in log)


@pytest.mark.parametrize("m, p", [(1, 2), (2, 2), (1, 3), (4, 4)])
def test_zb_v_with_few_microbatches_still_runs_every_task(m, p):
    """Below 2p - 1 micro-batches the orders leave out the missing micro-batches (as the
    authors' and PyTorch's do): valid, no deadlock, a larger bubble than the formula's."""
    schedule = pl.zb_v_schedule(m, p)
    pl.validate_schedule(schedule, 2 * p, m, num_devices=p, placement="v")
    assert pl.idle_fraction(schedule, p) > (p - 1) / (6 * m + p - 1)
    with pytest.raises(ValueError, match="the ZB-V formula holds for 2 chunks per device and "
                                         "num_microbatches >= 2 num_stages - 1"):
        pl.bubble_fraction(m, p, schedule="zb-v")


def test_placements_by_hand_and_errors():
    assert [pl.v_shape_device(s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [pl.stage_device(s, 6, 3) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [pl.stage_device(s, 4, 2, "v") for s in range(4)] == [0, 1, 1, 0]
    assert pl.infer_placement(["a", "b", "b", "a"]) == (["a", "b"], "v")
    assert pl.infer_placement(["a", "b", "a", "b"]) == (["a", "b"], "loop")
    assert pl.infer_placement(["a", "b"]) == (["a", "b"], "loop")
    with pytest.raises(ValueError, match=r"stage devices \['a', 'b', 'a', 'a'\]: give one "
                                         "device per stage"):
        pl.infer_placement(["a", "b", "a", "a"])
    with pytest.raises(ValueError, match="stage 4 is not one of the 4 stages a V places"):
        pl.v_shape_device(4, 2)
    with pytest.raises(ValueError, match="placement 'v' puts 2 stages on each device: 6 stages"):
        pl.stage_device(0, 6, 2, "v")
    with pytest.raises(ValueError, match="placement must be one of"):
        pl.device_orders([], 2, placement="zigzag")
    # the tick format does not say where stages run: ZB-V read with the loop placement puts
    # stages 0 and 2 (both on device 0 then) in tick 2
    with pytest.raises(ValueError, match=r"tick 2: a device runs two tasks at once \(\[\(0, 2, "
                                         r"'F'\), \(2, 0, 'F'\)\]\)"):
        pl.validate_schedule(pl.zb_v_schedule(4, 2), 4, 4, num_devices=2)
    with pytest.raises(ValueError, match=r"device 0's order holds \(1, 0, 'F'\).*placed on "
                                         r"device 0 \(placement 'v'\)"):
        pl.clock_schedule([[(1, 0, "F")], []], num_stages=4, placement="v")
    with pytest.raises(ValueError, match="num_chunks=3: 'zb-v' puts 2 chunks on each device"):
        pl.make_schedule("zb-v", 4, 2, 3)
    assert set(pl.SCHEDULE_PLACEMENT) == set(pl.SCHEDULES)
