"""accel.parallel.parameter_server and staleness: every mode against a hand-written loop of
plain single-device SGD; the server's decisions against written-out tables."""

import itertools
import threading

import numpy as np
import pytest
import tensorflow as tf

from accel import models
from accel.parallel import parameter_server as ps
from accel.parallel import staleness
from accel.training import squared_error

LR = 0.05
BATCH = 8


def gradient(params, x, y):
    """The gradient of the mean squared error at ``params`` (variables or arrays)."""
    params = [tf.Variable(p) for p in params]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(squared_error(y, models.mlp_apply(params, x)))
    return [g.numpy() for g in tape.gradient(loss, params)]


def reference_sgd(problem, batches_per_step, steps, lr=LR):
    """Plain SGD on one device; ``batches_per_step(t)`` gives the (x, y) of step ``t``."""
    params = [np.array(p) for p in problem["params"]]
    for t in range(steps):
        params = [p - lr * g for p, g in zip(params, gradient(params, *batches_per_step(t)),
                                             strict=True)]
    return params


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


def test_k_of_n_equals_a_hand_written_loop_over_its_records(problem, four_devices):
    """K < N: which gradients made each update depends on timing, so the run's records say which
    (worker, step) pairs were averaged; a plain loop replays exactly that and must agree."""
    workers = four_devices[1:]
    result = ps.train_k_of_n(**problem, workers=workers, ps_device=four_devices[0], k=2, steps=6,
                             batch_size=BATCH, optimizer=LR, step_time=0.004, slowdown={2: 3.0})
    shards = ps.worker_batches(problem["x"], problem["y"], len(workers), BATCH)
    params = [np.array(p) for p in problem["params"]]
    for version in range(6):
        used = [r for r in result.applied if r.applied_version == version]
        assert len(used) == 2 and {r.read_version for r in used} == {version}
        grads = [gradient(params, *shards[r.worker][r.step % len(shards[r.worker])])
                 for r in sorted(used, key=lambda r: r.worker)]
        params = [p - LR * (g0 + g1) / 2 for p, g0, g1 in zip(params, *grads, strict=True)]
    assert_params_close(result.params, params)


def test_delayed_k_equals_a_hand_written_stale_loop(problem, four_devices):
    """delay=2 with two workers: gradient g reads the parameters of version max(0, g - 2) and
    uses worker g % 2's batch g // 2, written out by hand."""
    workers = four_devices[1:3]
    result = ps.train_delayed(**problem, workers=workers, ps_device=four_devices[0], delay=2,
                              steps=7, batch_size=BATCH, optimizer=LR)
    shards = ps.worker_batches(problem["x"], problem["y"], len(workers), BATCH)
    history = [[np.array(p) for p in problem["params"]]]
    for g in range(7):
        read = history[max(0, g - 2)]
        w, step = g % 2, g // 2
        grad = gradient(read, *shards[w][step % len(shards[w])])
        history.append([p - LR * d for p, d in zip(history[-1], grad, strict=True)])
    assert result.staleness.tolist() == [0, 1, 2, 2, 2, 2, 2]
    assert_params_close(result.params, history[-1])


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

    with pytest.raises(RuntimeError, match="loss exploded"):
        ps.train_sync(**{**problem, "loss_fn": broken_loss}, workers=four_devices[1:],
                      ps_device=four_devices[0], steps=3, batch_size=BATCH)
    assert not worker_threads()


@pytest.mark.parametrize("bad, message", [
    ({"mode": "k_of_n", "k": 4}, r"k must be in 1..3 \(the number of workers\), got k=4"),
    ({"mode": "k_of_n", "k": 0}, "k must be in 1..3"),
    ({"mode": "sync", "workers": []}, "need at least one worker device"),
    ({"mode": "delayed", "delay": -1}, "delay must be an int >= 0 or a list of 3"),
    ({"mode": "delayed", "delay": [1, -2, 0]}, "delay must be an int >= 0"),
    ({"mode": "delayed", "delay": 1.5}, "delay must be an int >= 0"),
    ({"mode": "async", "slowdown": {5: 2.0}}, r"bad: \{5: 2.0\}"),
    ({"mode": "async", "slowdown": {0: 0.5}}, r"bad: \{0: 0.5\}"),
    ({"mode": "async", "step_time": -1.0}, "step_time must be a number >= 0, got -1.0"),
    ({"mode": "sideways"}, "mode must be one of .* got 'sideways'"),
    ({"mode": "sync", "steps": 0}, "steps must be an int >= 1, got 0"),
    ({"mode": "sync", "steps": 2.5}, "steps must be an int >= 1, got 2.5"),
    ({"mode": "sync", "optimizer": -0.1}, "a learning rate must be a number > 0, got -0.1"),
    ({"mode": "sync", "optimizer": True}, "a learning rate must be a number > 0, got True"),
    ({"mode": "sync", "batch_size": 1000}, "cannot give 3 workers a batch of 1000 each"),
    ({"mode": "sync", "k": 2}, "k=2 has no effect in mode 'sync'; the modes that use k: k_of_n"),
    ({"mode": "sync", "max_staleness": 1}, "max_staleness=1 has no effect in mode 'sync'"),
    ({"mode": "k_of_n", "k": 2, "warmup_steps": 3}, "warmup_steps=3 has no effect"),
    ({"mode": "async", "delay": 2}, "the modes that use delay: delayed"),
    ({"mode": "delayed", "delay": 1, "slowdown": {0: 2.0}}, "slowdown=.* has no effect"),
])
def test_bad_input_is_a_value_error_naming_it(problem, four_devices, bad, message):
    args = {"workers": four_devices[1:], "ps_device": four_devices[0], "steps": 3,
            "batch_size": BATCH, **bad}
    mode = args.pop("mode")
    with pytest.raises(ValueError, match=message):
        ps.train(mode, **problem, **args)


def test_numpy_learning_rate_is_a_learning_rate(problem, four_devices):
    common = dict(problem, workers=four_devices[1:], ps_device=four_devices[0], steps=2,
                  batch_size=BATCH)
    assert_params_close(ps.train_sync(**common, optimizer=np.float32(LR)).params,
                        ps.train_sync(**common, optimizer=LR).params)


def test_wall_time_stops_at_the_last_applied_update(problem, four_devices):
    """A counting clock: every call returns the next integer. The run's wall time must be the
    time of the last applied update, although the straggler keeps the clock running after it."""
    ticks = itertools.count()
    result = ps.train_async(**problem, workers=four_devices[1:], ps_device=four_devices[0],
                            steps=6, batch_size=BATCH, step_time=0.002, slowdown={2: 8.0},
                            clock=lambda: float(next(ticks)))
    assert result.wall_time == result.applied[-1].time
    assert result.wall_time < next(ticks)  # reading the clock after the run says later


def test_keras_optimizer_matches_learning_rate(problem, four_devices):
    common = dict(problem, workers=four_devices[1:], ps_device=four_devices[0], steps=3,
                  batch_size=BATCH)
    with_keras = ps.train_sync(**common, optimizer=tf.keras.optimizers.SGD(LR))
    assert_params_close(with_keras.params, ps.train_sync(**common, optimizer=LR).params)


def test_staleness_aware_learning_rate_by_hand(problem, four_devices):
    """staleness_lr (Zhang et al. 2016): a gradient tau updates stale moves the parameters by
    lr / tau, against a hand-written loop over the same reads; refused outside async modes and
    with an optimizer object."""
    common = dict(problem, workers=four_devices[1:2], ps_device=four_devices[0], steps=6,
                  batch_size=BATCH, optimizer=LR)
    shard = ps.worker_batches(problem["x"], problem["y"], 1, BATCH)[0]
    run = ps.train_delayed(**common, delay=2, staleness_lr=True)
    taus = run.staleness.tolist()
    assert taus == [0, 1, 2, 2, 2, 2]
    history = [[np.array(p) for p in problem["params"]]]
    for t, tau in enumerate(taus):
        g = gradient(history[t - tau], *shard[t % len(shard)])
        step = LR / max(tau, 1)
        history.append([p - step * gi for p, gi in zip(history[-1], g, strict=True)])
    assert_params_close(run.params, history[-1])
    plain = ps.train_delayed(**common, delay=2)
    assert max(np.abs(a - b).max() for a, b in zip(plain.params, run.params, strict=True)) > 1e-4
    with pytest.raises(ValueError, match="staleness_lr=True has no effect in mode 'sync'"):
        ps.train_sync(**dict(common, workers=four_devices[1:]), staleness_lr=True)
    with pytest.raises(ValueError, match="must be a learning rate"):
        ps.train_delayed(**dict(common, optimizer=tf.keras.optimizers.SGD(LR)), delay=2,
                         staleness_lr=True)


class Ticks:
    """A clock that advances by one at every call, so that times count clock readings."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def first_index_at_or_below(losses, target):
    return next(i for i, loss in enumerate(losses) if loss <= target)


@pytest.mark.parametrize("mode, extra", [("sync", {}), ("delayed", {"delay": 2})])
def test_target_loss_stops_at_the_first_update_that_gets_there(problem, four_devices, mode,
                                                               extra):
    """The same deterministic run without a target, its loss sampled after every update: the
    run with a target is its prefix up to the first sample at or below the target."""
    common = dict(problem, workers=four_devices[1:], ps_device=four_devices[0],
                  batch_size=BATCH, optimizer=LR, **extra)
    full = ps.train(mode, **common, steps=30, eval_every=1)
    losses = [loss for _, loss in full.curve]
    target = sorted(losses)[len(losses) // 2]  # reached half-way or earlier
    stop = first_index_at_or_below(losses, target)
    assert 0 < stop < 30
    run = ps.train(mode, **common, steps=30, target_loss=target)
    assert len(run.curve) == stop + 1
    np.testing.assert_allclose([loss for _, loss in run.curve], losses[:stop + 1], rtol=1e-6)
    assert staleness.first_reach(run, target).updates == stop
    assert run.records[-1].applied_version == stop - 1  # nothing was computed after it


def test_race_to_target_on_an_injected_clock(problem, four_devices):
    """Controlled delays have no threads: with a clock that ticks once per reading, a
    gradient's time is its number (the server reads the clock once per gradient, after the
    start), so seconds to the target are the gradients it took, and the ratio to the fresh
    run is the ratio of the updates that the full runs (no target) needed by hand."""
    common = dict(problem, mode="delayed", workers=four_devices[1:], ps_device=four_devices[0],
                  batch_size=BATCH, optimizer=LR, steps=60)
    fresh = ps.train_delayed(**{k: v for k, v in common.items() if k != "mode"}, delay=0,
                             eval_every=1)
    target = [loss for _, loss in fresh.curve][12]
    needed = {}
    for name, delay in (("fresh", 0), ("stale", 4)):
        full = ps.train_delayed(**{k: v for k, v in common.items() if k != "mode"},
                                delay=delay, eval_every=1)
        needed[name] = first_index_at_or_below([loss for _, loss in full.curve], target)
    race = ps.race_to_target({"fresh": dict(common, delay=0), "stale": dict(common, delay=4)},
                             target_loss=target, repeats=2, baseline="fresh", clock=Ticks())
    for name, n in needed.items():
        assert race["hits"][name] == [staleness.TargetHit(float(n), n, n * BATCH, n, 0)] * 2
        assert [len(r.records) for r in race["runs"][name]] == [n, n]
    summary = race["summary"]
    assert needed["stale"] > needed["fresh"] and summary["fresh"]["ratio"] == 1.0
    assert summary["stale"]["ratio"] == pytest.approx(needed["stale"] / needed["fresh"])
    assert summary["stale"]["median"] == summary["stale"]["min"] == float(needed["stale"])


def test_race_to_target_refuses_what_it_sets_itself(problem, four_devices):
    variant = dict(problem, mode="delayed", delay=1, workers=four_devices[1:], steps=5,
                   ps_device=four_devices[0], batch_size=BATCH)
    with pytest.raises(ValueError, match="leave target_loss and clock to race_to_target"):
        ps.race_to_target({"a": dict(variant, clock=Ticks())}, target_loss=1.0, repeats=1,
                          baseline="a")
    with pytest.raises(ValueError, match="give train's arguments with a mode"):
        ps.race_to_target({"a": {k: v for k, v in variant.items() if k != "mode"}},
                          target_loss=1.0, repeats=1, baseline="a")
    with pytest.raises(ValueError, match="baseline 'b' is not one of"):
        ps.race_to_target({"a": variant}, target_loss=1.0, repeats=1, baseline="b")
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        ps.race_to_target({"a": variant}, target_loss=1.0, repeats=0, baseline="a")
