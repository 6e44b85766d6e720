"""accel.course.strategies: the input table, the checkpoint-interval models (against Daly's own
worked examples and a simulation of random failures), the exercises."""

import math

import numpy as np
import pytest

from accel.course import strategies as course


def test_compact_groups_records_by_file():
    assert course.compact(["f0:0", "f0:1", "f0:2", "f2:0", "f3:1", "f3:3"]) == "f0:0-2 f2:0 f3:1,3"


def test_input_table_one_line_per_key():
    reports = [{"input": {"FILE": ["f0:0", "f0:1"]}}, {"input": {"FILE": ["f1:0", "f1:1"]}}]
    assert course.input_table(reports, ("FILE",)) == ["FILE  worker 0: f0:0-1 | worker 1: f1:0-1"]


def test_exercise_1_solution_and_placeholder():
    assert course.check_scale(None) == "exercise 1: not answered yet"
    # by hand: the MTBF divided by the scale, Young's interval, Daly's expected wall time
    mtbf = 54 * 24 * 3600 / 419
    save, restart = 405e9 * 14 / 2e12, 600.0
    solution = []
    for scale in (2, 8):
        m = mtbf / scale
        tau = math.sqrt(2 * save * m)
        solution.append(1 - tau / (m * math.exp(restart / m) * math.expm1((tau + save) / m)))
    assert course.check_scale(tuple(solution)) == "exercise 1: correct"
    assert 0.1 < solution[0] < solution[1] < 0.6  # more GPUs, more of the time lost
    assert course.check_scale((solution[1], solution[0])).startswith("exercise 1: not")
    assert "two fractions" in course.check_scale("six")
    assert "two fractions" in course.check_scale((0.1,))


def test_worked_example_constants():
    assert math.isclose(course.MTBF_16K / 3600, 3.093, abs_tol=1e-3)
    assert math.isclose(course.SAVE_STALL, 2.835)  # 5.67 TB at 2 TB/s
    assert course.RESTART == 600.0


def test_exercise_2_solution_and_the_fact_it_rests_on(tmp_path):
    assert course.check_backup_every_2_batches(None) == "exercise 2: not answered yet"
    assert course.check_backup_every_2_batches(False) == "exercise 2: correct"
    assert course.check_backup_every_2_batches(True).startswith("exercise 2: not True")
    # the fact, in Keras 3's source: a batch-level backup stores the batch reached, but fit
    # restarts at the saved epoch (keras/src/callbacks/backup_and_restore.py, _load_model)
    import inspect

    import keras
    source = inspect.getsource(keras.callbacks.BackupAndRestore._load_model)
    assert "_initial_epoch = epoch" in source and '["batch"]' not in source


def test_young_interval_by_hand():
    # sqrt(2 * 5 * 1440) = sqrt(14400) = 120
    assert course.young_interval(5.0, 1440.0) == pytest.approx(120.0)
    assert course.young_interval(50.0, 4.0) == pytest.approx(20.0)


def test_daly_interval_reproduces_dalys_worked_examples():
    # Daly (2006), figs. 3-5: dump time 5 min; M = 24 h, 6 h, 15 min -> 117, 57, 9.1 min
    assert round(course.daly_interval(5.0, 24 * 60)) == 117
    assert round(course.daly_interval(5.0, 6 * 60)) == 57
    assert round(course.daly_interval(5.0, 15.0), 1) == 9.1
    assert course.daly_interval(40.0, 15.0) == 15.0  # a save longer than 2M: every M


def simulated_lost_fraction(interval, save, restart, mtbf, segments=200_000, seed=0):
    """Random failures (exponential) during work, saves and restarts; lost work since the
    last save is redone: the fraction of wall time that was not useful compute."""
    rng = np.random.default_rng(seed)
    wall, need = 0.0, interval + save
    for _ in range(segments):
        while True:
            t = rng.exponential(mtbf)
            if t >= need:
                wall += need
                break
            wall += t
            while True:  # the restart itself may be interrupted
                r = rng.exponential(mtbf)
                if r >= restart:
                    wall += restart
                    break
                wall += r
    return 1.0 - segments * interval / wall


def test_lost_fraction_matches_a_simulation_and_the_first_order_terms():
    args = (300.0, 30.0, 120.0, 1800.0)  # failures often, so the simulation sees many
    assert course.lost_fraction(*args) == pytest.approx(simulated_lost_fraction(*args),
                                                        abs=0.01)
    # far from failures the loss is save/tau + (tau/2 + R)/M to first order
    tau, d, r, m = 600.0, 5.0, 60.0, 1e6
    first_order = d / tau + (tau / 2 + r) / m
    assert course.lost_fraction(tau, d, r, m) == pytest.approx(first_order, rel=0.01)
    assert course.lost_fraction(tau, 0.0, 0.0, m) == pytest.approx(tau / 2 / m, rel=0.01)


def test_interval_models_refuse_bad_input():
    with pytest.raises(ValueError, match="save_seconds"):
        course.young_interval(0.0, 100.0)
    with pytest.raises(ValueError, match="mtbf_seconds"):
        course.daly_interval(1.0, -1.0)
    with pytest.raises(ValueError, match="restart_seconds"):
        course.lost_fraction(10.0, 1.0, -1.0, 100.0)
    with pytest.raises(ValueError, match="interval_seconds"):
        course.lost_fraction(0.0, 1.0, 1.0, 100.0)


def test_worked_example_restart_dominates_the_plain_save_loss():
    mtbf = 54 * 24 * 3600 / 419  # the chapter's worked example

    def lost(save, restart):
        return course.lost_fraction(course.young_interval(save, mtbf), save, restart, mtbf)

    save = course.SAVE_STALL
    base = lost(save, 600.0)
    assert lost(save, 300.0) < lost(save / 2, 600.0) < base
    assert math.isclose(mtbf / 3600, 3.093, abs_tol=1e-3)


def test_exercise_3_solution_restart_on_one_device_is_close_not_equal(tmp_path, four_devices):
    assert course.check_restart_on_fewer_workers(None) == "exercise 3: not answered yet"
    assert course.check_restart_on_fewer_workers(False) == "exercise 3: correct"
    assert course.check_restart_on_fewer_workers(True).startswith("exercise 3: not True")
    assert "answer True or False" in course.check_restart_on_fewer_workers("no")
    # the solution, run: two replicas checkpoint at step 2; one device resumes to step 6
    import tensorflow as tf

    from accel import datasets, models
    from accel.parallel import strategies

    devs = four_devices
    x, y, _ = datasets.regression(256, 8, 1, seed=0)

    def make():
        return models.keras_mlp([8, 16, 1])

    two = strategies.make_strategy("mirrored", devs[:2], "reduction_to_one_device")
    whole = strategies.train_loop(two, make, x, y, 32, 6, 0.05)
    strategies.train_loop(two, make, x, y, 32, 2, 0.05, checkpoint_dir=str(tmp_path), every=2)
    one = strategies.train_loop(tf.distribute.get_strategy(), make, x, y, 32, 6, 0.05,
                                checkpoint_dir=str(tmp_path))
    assert one.start == 2
    gap = models.max_difference(one.weights, whole.weights)
    assert 0.0 < gap
    for a, b in zip(one.weights, whole.weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
