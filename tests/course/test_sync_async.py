"""accel.course.sync_async: the exercise checks with the right answers and wrong ones (the
chapter stores only the unsolved placeholders), the harness overhead and ratios against
hand-computed times, the figures."""

import matplotlib.pyplot as plt
import pytest

from accel.course import sync_async
from accel.parallel import parameter_server as ps
from accel.parallel import staleness
from accel.parallel.staleness import TrainResult, UpdateRecord


def test_exercises_answered_right():
    # 1: momentum 0.9 makes each gradient act about 1 / (1 - 0.9) = 10 times over the next
    #    updates, so at lr 0.02 even delay 1 diverges (nan; plain SGD shrugs off 1 and 4);
    #    without delay it converges (final loss about 0.01): test_exercise_1_answer_holds
    assert sync_async.check_exercise(1, 0).startswith("exercise 1: correct")
    # 2: a constant delay 8 diverges at lr 0.02 (final loss about 3.7); geometric delays with
    #    mean 8 converge (about 0.05): most are shorter than the mean and they vary, so the
    #    overshoots of a fixed lag do not line up
    assert sync_async.check_exercise(2, "constant") == "exercise 2: correct"
    # 3: while the straggler computes for 4 step times, each of the 2 fast workers applies
    #    about 4 updates: 8, less the ones that land just after it (measured: 6 to 8, mostly 7)
    assert sync_async.check_exercise(3, 8) == "exercise 3: correct"
    assert sync_async.check_exercise(3, 7) == "exercise 3: correct"


@pytest.mark.parametrize("number, answer, hint", [
    (1, 1, "run delay 1"), (1, 4, "run delay 1"), (1, 3, "one of the delays"),
    (1, True, "one of the delays"),
    (2, "random", "run both"), (2, "both", '"constant" or "random"'),
    (3, 2, "BOTH fast workers"), (3, 4, "BOTH fast workers"), (3, 12, "4 step times"),
    (3, 7.5, "whole number"), (3, True, "whole number")])
def test_exercises_answered_wrong(number, answer, hint):
    verdict = sync_async.check_exercise(number, answer)
    assert "correct" not in verdict and hint in verdict


def test_exercises_not_answered_yet():
    for placeholder in (None, ...):
        assert [sync_async.check_exercise(n, placeholder) for n in (1, 2, 3)] == [
            f"exercise {n}: not answered yet" for n in (1, 2, 3)]
    with pytest.raises(ValueError, match="number must be one of"):
        sync_async.check_exercise(4, 1)


def test_exercise_2_answer_holds(four_devices):
    """The fact behind exercise 2's answer, on the chapter's problem (deterministic)."""
    common = dict(sync_async.toy_problem(), workers=four_devices[1:], ps_device=four_devices[0],
                  steps=300, optimizer=0.02)
    constant = ps.train_delayed(**common, delay=8)
    random = ps.train_delayed(**common, delay=staleness.delay_schedule(300, 8))
    assert constant.final_loss > 1 > 0.5 > random.final_loss


def test_exercise_1_answer_holds(four_devices):
    """The fact behind exercise 1's answer, on the chapter's problem (deterministic, no
    threads): SGD with momentum 0.9 at 0.02 converges without delay and blows up at delay 1
    (60 updates show both: loss about 0.2 against nan)."""
    import keras

    common = dict(sync_async.toy_problem(), workers=four_devices[1:], ps_device=four_devices[0],
                  steps=60)
    runs = [ps.train_delayed(**common, delay=k, optimizer=keras.optimizers.SGD(0.02, momentum=0.9))
            for k in (0, 1)]
    assert runs[0].final_loss < 0.5
    assert not runs[1].final_loss < 1  # nan or far above


def records(times_by_worker):
    return [UpdateRecord(w, 0, 0, 0.0, t, 32) for w, ts in times_by_worker.items() for t in ts]


def test_explain_ratios_against_hand_computed_times(capsys):
    """sync: 30 gradients in 0.3 s = 10 rounds of 0.03 s; async, equal workers: a cycle of
    0.025 s; with the straggler, fast workers every 0.04 s, the straggler every 0.1 s
    (effective slowdown 2.5); 2-of-3: 20 gradients in 0.2 s = 10 rounds of 0.02 s. By hand:
    overheads 0.03 - 0.02 = 0.01 and 0.025 - 0.02 = 0.005; async 0.03 / 0.025 = 1.2; with the
    straggler 0.03/3 * (2/0.04 + 1/0.1) = 0.6; 2-of-3 2/3 * 0.03/0.02 = 1. Measured: examples
    per second over sync's 30 * 32 / 0.3 = 3200: async 9 * 32 / 0.1 = 2880 -> 0.9, with the
    straggler 8 * 32 / 0.2 = 1280 -> 0.4, 2-of-3 20 * 32 / 0.2 = 3200 -> 1."""
    runs = {"sync": TrainResult("sync", [], records({0: [0.0] * 10, 1: [0.0] * 10,
                                                     2: [0.0] * 10}), 0.3, 0.0),
            "async": TrainResult("async", [], records(
                {0: [0.0, 0.025, 0.05], 1: [0.0, 0.025, 0.05], 2: [0.0, 0.025, 0.05]}), 0.1,
                0.0),
            "async, straggler": TrainResult("async", [], records(
                {0: [0.04, 0.08, 0.12], 1: [0.05, 0.09, 0.13], 2: [0.1, 0.2]}), 0.2, 0.0),
            "2-of-3, straggler": TrainResult("k_of_n", [], records({0: [0.0] * 10,
                                                                    1: [0.0] * 10}), 0.2, 0.0)}
    facts = sync_async.explain_ratios(runs, n=3, factor=4.0, step_time=0.02)
    expected = {"sync_round": 0.03, "sync_overhead": 0.01, "async_cycle": 0.025,
                "async_overhead": 0.005, "fast_cycle": 0.04, "straggler_cycle": 0.1,
                "effective_slowdown": 2.5, "kofn_round": 0.02,
                "async_ideal": 1.0, "async_from_times": 1.2, "async_measured": 0.9,
                "async_straggler_ideal": 0.75, "async_straggler_from_times": 0.6,
                "async_straggler_measured": 0.4,
                "kofn_ideal": 2 / 3, "kofn_from_times": 1.0, "kofn_measured": 1.0}
    assert {k: facts[k] for k in expected} == pytest.approx(expected)
    out = capsys.readouterr().out
    assert "sync round    30.0 ms: harness overhead  10.0 ms =  33% of the round" in out
    assert "effective slowdown 2.50 (padded: 4)" in out


@pytest.mark.slow  # several seconds: left to make test, out of make quick
def test_figures_build(four_devices):
    fig = sync_async.figure_staleness()
    assert len(fig.axes) == 2
    plt.close(fig)
    run = TrainResult("sync", [], [], 1.0, 0.1, curve=[(0, 1.0), (96, 0.5)],
                      curve_time=[0.0, 0.5])
    fig = sync_async.figure_race({"a": run, "b": run})
    assert [len(ax.lines) for ax in fig.axes] == [2]
    plt.close(fig)


@pytest.mark.parametrize("method", ["apply", "apply_locked", "sparse_apply_locked"])
def test_exclusive_lock_loses_nothing(four_devices, method):
    """A dense update takes the variable's exclusive lock whatever use_locking says
    (training_ops.cc: ApplyGradientDescentOp passes sparse=false), and a sparse one with
    use_locking=True: every one of threads x repeats additions survives (hand count)."""
    race = sync_async.race_increments(four_devices[0], method, threads=3, repeats=20,
                                      size=1 << 12)
    assert race == {"expected": 60, "lowest": 60.0, "lost": 0.0}


@pytest.mark.parametrize("method", ["sparse_apply", "read_then_assign"])
def test_unlocked_increments_lose_at_most_what_was_sent(four_devices, method):
    race = sync_async.race_increments(four_devices[0], method, threads=3, repeats=20, size=1 << 12)
    assert race["expected"] == 60 and 0 <= race["lost"] < 60
    assert 1 <= race["lowest"] <= 60


@pytest.mark.parametrize("method", ["read_then_assign", "sparse_apply"])
def test_one_thread_never_loses_an_increment(four_devices, method):
    race = sync_async.race_increments(four_devices[0], method, threads=1, repeats=7, size=128)
    assert race == {"expected": 7, "lowest": 7.0, "lost": 0.0}


def test_sparse_race_needs_whole_rows(four_devices):
    with pytest.raises(ValueError, match="multiple of 64"):
        sync_async.race_increments(four_devices[0], "sparse_apply", size=100)


def test_the_chapters_decision_rule_is_the_librarys():
    """Chapter 06 writes the server's decision by hand (the cell defining ``decide``); it must
    agree with ``staleness.server_decision`` on every case of a small grid."""
    import itertools
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[2] / "chapters/06_sync_vs_async.ipynb").read_text())
    (source,) = ["".join(c["source"]) for c in nb["cells"]
                 if c["cell_type"] == "code" and "".join(c["source"]).startswith("def decide(")]
    scope = {}
    exec(source, scope)
    decide = scope["decide"]
    for mode, read, held, k, cap in itertools.product(("sync", "k_of_n", "async"), range(4),
                                                      range(3), (1, 2, 3), (None, 0, 2)):
        if held >= k or (cap is not None and mode != "async"):
            continue
        want = staleness.server_decision(mode, 3, read, held, k, cap)
        assert decide(mode, 3, read, held, k, cap) == want, (mode, read, held, k, cap)


def test_time_to_target_figure_draws_the_summary():
    """One bar per variant at its median, whiskers from min to max, straggler runs hatched."""
    summary = {"sync": {"median": 1.0, "min": 0.9, "max": 1.2},
               "sync, straggler": {"median": 3.0, "min": 2.5, "max": 3.5}}
    fig = sync_async.figure_time_to_target(summary)
    ax = fig.axes[0]
    assert [p.get_width() for p in ax.patches] == [1.0, 3.0]
    assert [p.get_hatch() for p in ax.patches] == [None, "//"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["sync", "sync, straggler"]
    (segments,) = [c for c in ax.collections if len(c.get_segments()) == 2]
    assert [tuple(s[:, 0]) for s in segments.get_segments()] == [(0.9, 1.2), (2.5, 3.5)]
    plt.close(fig)
