"""accel.parameter_server and accel.staleness: every mode against plain single-device SGD."""

import threading

import numpy as np
import pytest
import tensorflow as tf

from accel import models, staleness
from accel import parameter_server as ps

LR = 0.05
BATCH = 8


@pytest.fixture(scope="module")
def problem():
    return ps.toy_problem(n=96, features=4, hidden=8)


def reference_sgd(problem, batches_per_step, steps, lr=LR):
    """Plain SGD on one device; ``batches_per_step(t)`` gives the (x, y) of step ``t``."""
    params = [tf.Variable(p) for p in problem["params"]]
    for t in range(steps):
        x, y = batches_per_step(t)
        with tf.GradientTape() as tape:
            loss = ps.mse(y, models.mlp_apply(params, x))
        for v, g in zip(params, tape.gradient(loss, params), strict=True):
            v.assign_sub(lr * g)
    return [v.numpy() for v in params]


def assert_params_close(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def worker_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ps-worker-")]


def test_sync_equals_single_device_sgd_on_concatenated_batch(problem, four_devices):
    workers, steps = four_devices[1:], 5
    result = ps.train_sync(**problem, workers=workers, ps_device=four_devices[0], steps=steps,
                           batch_size=BATCH, optimizer=LR)
    shards = ps.worker_batches(problem["x"], problem["y"], len(workers), BATCH)

    def concatenated(t):
        parts = [shard[t % len(shard)] for shard in shards]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    assert_params_close(result.params, reference_sgd(problem, concatenated, steps))
    assert len(result.records) == steps * len(workers)
    assert set(result.staleness.tolist()) == {0}


def test_k_of_n_with_k_equal_n_is_sync(problem, four_devices):
    common = dict(problem, workers=four_devices[1:], ps_device=four_devices[0], steps=4,
                  batch_size=BATCH, optimizer=LR)
    sync = ps.train_sync(**common)
    k_of_n = ps.train_k_of_n(**common, k=3)
    assert_params_close(k_of_n.params, sync.params)
    assert not any(r.dropped for r in k_of_n.records)


def test_k_of_n_drops_a_stragglers_late_gradients(problem, four_devices):
    result = ps.train_k_of_n(**problem, workers=four_devices[1:], ps_device=four_devices[0],
                             k=2, steps=12, batch_size=BATCH, step_time=0.005, slowdown={2: 4.0})
    assert len(result.applied) == 2 * 12
    assert set(result.staleness.tolist()) == {0}
    assert result.dropped_by_worker(3)[2] >= 1


def test_async_with_one_worker_is_plain_sgd(problem, four_devices):
    steps = 7
    result = ps.train_async(**problem, workers=four_devices[1:2], ps_device=four_devices[0],
                            steps=steps, batch_size=BATCH, optimizer=LR)
    shard = ps.worker_batches(problem["x"], problem["y"], 1, BATCH)[0]
    assert_params_close(result.params, reference_sgd(problem, lambda t: shard[t % len(shard)],
                                                     steps))
    assert set(result.staleness.tolist()) == {0}


def test_async_with_several_workers_has_stale_updates(problem, four_devices):
    result = ps.train_async(**problem, workers=four_devices[1:], ps_device=four_devices[0],
                            steps=30, batch_size=BATCH, step_time=0.003)
    assert len(result.applied) == 30
    assert result.staleness.max() >= 1
    assert sorted(r.applied_version for r in result.applied) == list(range(30))
    assert not worker_threads()


def test_delay_zero_is_plain_sgd_and_delay_k_reads_k_versions_back(problem, four_devices):
    common = dict(problem, workers=four_devices[1:2], ps_device=four_devices[0], steps=6,
                  batch_size=BATCH, optimizer=LR)
    shard = ps.worker_batches(problem["x"], problem["y"], 1, BATCH)[0]
    plain = reference_sgd(problem, lambda t: shard[t % len(shard)], 6)
    assert_params_close(ps.train_delayed(**common, delay=0).params, plain)
    delayed = ps.train_delayed(**common, delay=2)
    assert delayed.staleness.tolist() == [0, 1, 2, 2, 2, 2]
    again = ps.train_delayed(**common, delay=2)
    assert_params_close(again.params, delayed.params)


def test_max_staleness_drops_and_warmup_removes_delay(problem, four_devices):
    common = dict(problem, workers=four_devices[1:], ps_device=four_devices[0], steps=9,
                  batch_size=BATCH)
    dropped = ps.train_delayed(**common, delay=[0, 3, 0] * 3, max_staleness=1)
    assert [r.dropped for r in dropped.records] == [False, False, False, False, True, False,
                                                   False, True, False]
    warm = ps.train_delayed(**common, delay=4, warmup_steps=5)
    assert warm.staleness.tolist()[:5] == [0] * 5


def test_worker_error_propagates_and_no_thread_is_left(problem, four_devices):
    x = problem["x"].copy()
    x[-1, 0] = np.nan  # only the last worker's shard holds it

    def checked_model(params, inputs):
        return models.mlp_apply(params, tf.debugging.check_numerics(inputs, "bad input"))

    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        ps.train_async(**{**problem, "x": x, "model_fn": checked_model}, batch_size=32,
                       workers=four_devices[1:], ps_device=four_devices[0], steps=50)
    assert any("worker 2" in note for note in info.value.__notes__)
    assert not worker_threads()

    def broken_loss(y, pred):
        raise RuntimeError("loss exploded")

    with pytest.raises(Exception, match="loss exploded"):  # autograph wraps errors at tracing
        ps.train_sync(**{**problem, "loss_fn": broken_loss}, workers=four_devices[1:],
                      ps_device=four_devices[0], steps=3, batch_size=BATCH)
    assert not worker_threads()


@pytest.mark.parametrize("bad", [
    {"mode": "k_of_n", "k": 4}, {"mode": "k_of_n", "k": 0}, {"mode": "sync", "workers": []},
    {"mode": "delayed", "delay": -1}, {"mode": "delayed", "delay": [1, -2, 0]},
    {"mode": "async", "slowdown": {5: 2.0}}, {"mode": "async", "slowdown": {0: 0.5}},
    {"mode": "async", "step_time": -1.0}, {"mode": "sideways"}, {"mode": "sync", "steps": 0},
    {"mode": "sync", "optimizer": -0.1}, {"mode": "sync", "batch_size": 1000},
])
def test_bad_input_is_a_value_error(problem, four_devices, bad):
    args = {"workers": four_devices[1:], "ps_device": four_devices[0], "steps": 3,
            "batch_size": BATCH, **bad}
    mode = args.pop("mode")
    with pytest.raises(ValueError):
        ps.train(mode, **problem, **args)


def test_keras_optimizer_matches_learning_rate(problem, four_devices):
    common = dict(problem, workers=four_devices[1:], ps_device=four_devices[0], steps=3,
                  batch_size=BATCH)
    with_keras = ps.train_sync(**common, optimizer=tf.keras.optimizers.SGD(LR))
    assert_params_close(with_keras.params, ps.train_sync(**common, optimizer=LR).params)


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
    with pytest.raises(ValueError):
        staleness.delay_schedule(5, -1.0)


def test_figure_staleness_builds(four_devices):
    import matplotlib.pyplot as plt

    fig = ps.figure_staleness()
    assert len(fig.axes) == 2
    plt.close(fig)
