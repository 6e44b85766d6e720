"""accel.course.sync_async: the exercise checks with the right answers (the chapter stores only
the unsolved placeholders), the ratio explanation against hand-computed times, the figures."""

import matplotlib.pyplot as plt
import pytest

from accel.course import sync_async
from accel.parallel.staleness import TrainResult, UpdateRecord


def test_exercises_answered_right(four_devices):
    # 1: a learning rate small enough that delay 16 converges
    assert sync_async.check_exercise(1, 0.005, four_devices) == "exercise 1: correct"
    # 2: K-of-N with k=1 is synchronous: a gradient of an older version is dropped, so every
    #    applied one is fresh (the other workers' gradients of that round are late: dropped)
    assert sync_async.check_exercise(2, 0) == "exercise 2: correct"
    # 3: sync runs at the straggler's pace: 1/8 of its straggler-free throughput, ideally
    assert sync_async.check_exercise(3, 1 / 8) == "exercise 3: correct"


@pytest.mark.parametrize("number, answer", [(1, 0.03), (1, "fast"), (2, 2), (2, False),
                                            (3, 0.75)])
def test_exercises_answered_wrong(four_devices, number, answer):
    assert "correct" not in sync_async.check_exercise(number, answer, four_devices)


def test_exercises_not_answered_yet():
    assert [sync_async.check_exercise(n, None) for n in (1, 2, 3)] == [
        f"exercise {n}: not answered yet" for n in (1, 2, 3)]
    with pytest.raises(ValueError, match="number must be one of"):
        sync_async.check_exercise(4, 1)


def records(times_by_worker):
    return [UpdateRecord(w, 0, 0, 0.0, t, 32) for w, ts in times_by_worker.items() for t in ts]


def test_explain_ratios_against_hand_computed_times(capsys):
    """sync: 30 gradients in 0.3 s = 10 rounds of 0.03 s; async: fast workers every 0.04 s,
    the straggler every 0.1 s (effective slowdown 2.5); 2-of-3: 20 gradients in 0.2 s = 10
    rounds of 0.02 s. By hand: async 0.03/3 * (2/0.04 + 1/0.1) = 0.6, 2-of-3 2/3 * 0.03/0.02 = 1."""
    runs = {"sync": TrainResult("sync", [], records({0: [0.0] * 10, 1: [0.0] * 10,
                                                     2: [0.0] * 10}), 0.3, 0.0),
            "async, straggler": TrainResult("async", [], records(
                {0: [0.04, 0.08, 0.12], 1: [0.05, 0.09, 0.13], 2: [0.1, 0.2]}), 0.2, 0.0),
            "2-of-3, straggler": TrainResult("k_of_n", [], records({0: [0.0] * 10,
                                                                    1: [0.0] * 10}), 0.2, 0.0)}
    facts = sync_async.explain_ratios(runs, n=3, factor=4.0, step_time=0.02)
    assert facts["sync_round"] == pytest.approx(0.03)
    assert facts["fast_cycle"] == pytest.approx(0.04)
    assert facts["straggler_cycle"] == pytest.approx(0.1)
    assert facts["effective_slowdown"] == pytest.approx(2.5)
    assert facts["async_ideal"] == pytest.approx(0.75)
    assert facts["async_from_times"] == pytest.approx(0.6)
    assert facts["kofn_ideal"] == pytest.approx(2 / 3)
    assert facts["kofn_from_times"] == pytest.approx(1.0)
    assert "effective slowdown 2.50 (padded: 4)" in capsys.readouterr().out


@pytest.mark.slow  # several seconds: left to make test, out of make quick
def test_figures_build(four_devices):
    fig = sync_async.figure_staleness()
    assert len(fig.axes) == 2
    plt.close(fig)
    run = TrainResult("sync", [], [], 1.0, 0.1, curve=[(0, 1.0), (96, 0.5)],
                      curve_time=[0.0, 0.5])
    fig = sync_async.figure_race({"a": run, "b": run})
    assert [len(ax.lines) for ax in fig.axes] == [2, 2]
    plt.close(fig)


def test_locked_increments_lose_nothing(four_devices):
    """With use_locking=True every one of threads x repeats additions survives (hand count)."""
    race = sync_async.race_increments(four_devices[0], "apply_locked", threads=3, repeats=20,
                                   size=1 << 12)
    assert race == {"expected": 60, "lowest": 60.0, "lost": 0.0}


@pytest.mark.parametrize("method", ["apply", "read_then_assign"])
def test_unlocked_increments_lose_at_most_what_was_sent(four_devices, method):
    race = sync_async.race_increments(four_devices[0], method, threads=3, repeats=20, size=1 << 12)
    assert race["expected"] == 60 and 0 <= race["lost"] < 60
    assert 1 <= race["lowest"] <= 60


def test_one_thread_never_loses_an_increment(four_devices):
    race = sync_async.race_increments(four_devices[0], "read_then_assign", threads=1, repeats=7,
                                   size=16)
    assert race == {"expected": 7, "lowest": 7.0, "lost": 0.0}
