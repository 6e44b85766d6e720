"""accel.parallel.staleness: the server's decisions against written-out tables, overlap
counting against hand-drawn spans, the analysis of records against hand counts."""

import numpy as np
import pytest

from accel.parallel import staleness


@pytest.mark.parametrize("mode, version, read, pending, k, max_staleness, expected", [
    # sync / K-of-N: fresh gradients are held until the k-th, late ones are dropped
    ("sync", 0, 0, 0, 3, None, "hold"),
    ("sync", 0, 0, 1, 3, None, "hold"),
    ("sync", 0, 0, 2, 3, None, "apply"),
    ("sync", 1, 0, 0, 3, None, "drop"),
    ("k_of_n", 4, 4, 1, 2, None, "apply"),
    ("k_of_n", 5, 4, 0, 2, None, "drop"),
    ("k_of_n", 5, 5, 0, 1, None, "apply"),
    # async / delayed: applied on arrival unless staler than max_staleness
    ("async", 7, 3, 0, 1, None, "apply"),
    ("async", 7, 3, 0, 1, 4, "apply"),
    ("async", 7, 3, 0, 1, 3, "drop"),
    ("delayed", 2, 2, 0, 1, 0, "apply"),
    ("delayed", 3, 2, 0, 1, 0, "drop"),
    # hogwild: no server decides, every worker applies its own gradient
    ("hogwild", 9, 2, 0, 1, None, "apply"),
])
def test_server_decision_table(mode, version, read, pending, k, max_staleness, expected):
    assert staleness.server_decision(mode, version, read, pending, k, max_staleness) == expected


@pytest.mark.parametrize("mode, version, last_read, worker, warmup, expected", [
    ("sync", 0, -1, 2, 0, True),   # first read
    ("sync", 3, 3, 2, 0, False),   # already contributed to version 3
    ("sync", 4, 3, 2, 0, True),
    ("k_of_n", 4, 4, 0, 0, False),
    ("async", 0, -1, 1, 5, False),  # warm-up: only worker 0
    ("async", 0, -1, 0, 5, True),
    ("async", 5, 2, 1, 5, True),   # after the warm-up, everyone, any time
    ("async", 2, 2, 1, 0, True),
    ("hogwild", 0, -1, 2, 0, True),
])
def test_may_read_table(mode, version, last_read, worker, warmup, expected):
    assert staleness.may_read(mode, version, last_read, worker, warmup) is expected


@pytest.mark.parametrize("version, delay, index, warmup, expected", [
    (0, 4, 0, 0, 0), (3, 4, 3, 0, 0), (10, 4, 10, 0, 6), (10, 4, 2, 5, 10), (10, 0, 10, 0, 10),
])
def test_delayed_read_version_table(version, delay, index, warmup, expected):
    assert staleness.delayed_read_version(version, delay, index, warmup) == expected


def test_rules_refuse_impossible_states():
    with pytest.raises(ValueError, match="need read_version <= version"):
        staleness.server_decision("async", 1, 2, 0)
    with pytest.raises(ValueError, match="mode must be one of"):
        staleness.server_decision("downpour", 1, 1, 0)



def test_records_analysis():
    recs = [staleness.UpdateRecord(0, 0, 0, 1.0, 0.1, 8),
            staleness.UpdateRecord(1, 0, 1, 1.0, 0.2, 8),
            staleness.UpdateRecord(2, 0, 3, 1.0, 0.3, 8),
            staleness.UpdateRecord(2, 1, 5, 1.0, 0.4, 8, dropped=True)]
    assert staleness.staleness_histogram(recs).tolist() == [1, 1, 0, 1]
    result = staleness.TrainResult("async", [], recs, wall_time=0.5, final_loss=0.1)
    facts = staleness.summarize(result)
    assert (facts["applied"], facts["dropped"], facts["max_staleness"]) == (3, 1, 3)
    assert result.examples == 24 and result.examples_per_s == 48.0
    assert result.dropped_by_worker(3) == [0, 0, 1]
    sched = staleness.delay_schedule(50, 3.0, seed=1)
    assert sched == staleness.delay_schedule(50, 3.0, seed=1) and min(sched) >= 0
    with pytest.raises(ValueError, match="mean_delay >= 0, got steps=5, mean_delay=-1.0"):
        staleness.delay_schedule(5, -1.0)


@pytest.mark.parametrize("spans, others, expected", [
    ([(0, 2), (3, 4)], None, 0),                 # apart
    ([(0, 2), (2, 4)], None, 0),                 # touching at an end point only
    ([(0, 2), (1, 4)], None, 2),                 # both overlap the other
    ([(0, 10), (1, 2), (3, 4), (11, 12)], None, 3),
    ([(0, 1), (5, 6)], [(0.5, 0.7)], 1),         # reads against updates
    ([(0, 1), (5, 6)], [(1, 5)], 0),
    ([], None, 0),
])
def test_count_overlaps_table(spans, others, expected):
    assert staleness.count_overlaps(spans, others) == expected


def test_count_overlaps_refuses_a_backwards_span():
    with pytest.raises(ValueError, match=r"start <= end, got \(3, 1\)"):
        staleness.count_overlaps([(0, 1), (3, 1)])


def test_hogwild_takes_a_learning_rate_only():
    with pytest.raises(ValueError, match="hogwild applies plain SGD .* got object"):
        staleness.check_train_arguments("hogwild", 3, 5, optimizer=object())
    with pytest.raises(ValueError, match="max_staleness=2 has no effect in mode 'hogwild'"):
        staleness.check_train_arguments("hogwild", 3, 5, max_staleness=2)
    assert staleness.check_train_arguments("hogwild", 3, 5, step_time=0.01,
                                           slowdown={2: 4.0}) == []


def hit(seconds, updates=1, examples=32, gradients=1, dropped=0):
    return staleness.TargetHit(seconds, updates, examples, gradients, dropped)


def test_first_reach_against_a_hand_written_run():
    """A k_of_n run (k = 2 of 3) by hand: version 0 at loss 4; the update at t = 0.2 (two
    gradients, one late one dropped at t = 0.25) gives loss 2; the update at t = 0.5 gives 0.9.
    Target 1: reached at t = 0.5 after 2 updates of 64 examples, 5 gradients arrived, 1
    dropped; target 3: at t = 0.2; target 0.5: never."""
    recs = [staleness.UpdateRecord(0, 0, 0, 1.0, 0.1, 32),
            staleness.UpdateRecord(1, 0, 0, 1.0, 0.2, 32),
            staleness.UpdateRecord(2, 0, 1, 1.0, 0.25, 32, dropped=True),
            staleness.UpdateRecord(0, 1, 1, 1.0, 0.4, 32),
            staleness.UpdateRecord(2, 1, 1, 1.0, 0.5, 32),
            staleness.UpdateRecord(1, 1, 2, 1.0, 0.6, 32, dropped=True)]
    run = staleness.TrainResult("k_of_n", [], recs, 0.5, 0.9,
                                curve=[(0, 4.0), (64, 2.0), (128, 0.9)],
                                curve_time=[0.0, 0.2, 0.5])
    assert staleness.first_reach(run, 1.0) == hit(0.5, 2, 128, 5, 1)
    assert staleness.first_reach(run, 3.0) == hit(0.2, 1, 64, 2, 0)
    assert staleness.first_reach(run, 4.0) == hit(0.0, 0, 0, 0, 0)
    assert staleness.first_reach(run, 0.5) is None
    with pytest.raises(ValueError, match="target_loss must be a number > 0"):
        staleness.first_reach(run, 0)
    with pytest.raises(ValueError, match="curve has 3 samples but curve_time 1"):
        staleness.first_reach(staleness.TrainResult("sync", [], recs, 0.5, 0.9, run.curve,
                                                    [0.0]), 1.0)
    with pytest.raises(ValueError, match="hogwild run's versions"):
        staleness.first_reach(staleness.TrainResult("hogwild", [], recs, 0.5, 0.9), 1.0)


def test_race_summary_against_hand_computed_medians():
    """sync takes 1, 3, 10 s, async 4, 3, 5 s: medians 3 and 4, but the ratio is the median of
    the ratios within each repetition, 4/1, 3/3, 5/10 -> 1 (not 4/3). A run that never got
    there counts as infinitely late and is left out of the counts' medians."""
    hits = {"sync": [hit(1.0, 8), hit(3.0, 8), hit(10.0, 8)],
            "async": [hit(4.0, 20), hit(3.0, 24), hit(5.0, 27)],
            "stuck": [hit(2.0, 30, gradients=40, dropped=10), None, None]}
    out = staleness.race_summary(hits, "sync")
    assert out["sync"] == {"median": 3.0, "min": 1.0, "max": 10.0, "reached": 3, "ratio": 1.0,
                           "updates": 8.0, "examples": 32.0, "gradients": 1.0, "dropped": 0.0}
    assert (out["async"]["median"], out["async"]["ratio"], out["async"]["updates"]) == (
        4.0, 1.0, 24.0)
    assert out["stuck"]["reached"] == 1 and out["stuck"]["median"] == np.inf
    assert out["stuck"]["ratio"] == np.inf and out["stuck"]["min"] == 2.0
    assert (out["stuck"]["gradients"], out["stuck"]["dropped"]) == (40.0, 10.0)
    with pytest.raises(ValueError, match="baseline 'ring' is not one of"):
        staleness.race_summary(hits, "ring")
    with pytest.raises(ValueError, match="same number"):
        staleness.race_summary({"sync": [hit(1.0)], "async": []}, "sync")


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "hogwild", "target_loss": 0.5}, "target_loss=0.5 has no effect in mode 'hogwild'"),
    ({"mode": "sync", "target_loss": 0}, "target_loss must be a number > 0, got 0"),
    ({"mode": "sync", "target_loss": float("inf")}, "target_loss must be a finite number"),
    ({"mode": "async", "target_loss": 0.5, "eval_every": 10}, "eval_every must be 0 or 1"),
])
def test_target_loss_arguments_are_checked(kwargs, message):
    mode = kwargs.pop("mode")
    with pytest.raises(ValueError, match=message):
        staleness.check_train_arguments(mode, 3, 5, **kwargs)
