"""accel.parallel.pipeline_exec: any schedule run on devices equals the single-device step
(loss, gradients, weights after a few updates); each device ran its tasks in the schedule's
order; stash counts are exact; bad input is refused before anything runs."""

import itertools
import threading

import numpy as np
import pytest
import tensorflow as tf

from accel import datasets, models
from accel.parallel import partition
from accel.parallel import pipeline as pl
from accel.parallel import pipeline_exec as pe
from accel.parallel.layers import dense, linear
from accel.training import squared_error

SIZES = [8, 16, 16, 16, 1]  # 4 dense layers
LR = 0.05


def assert_close(actual, ref):
    ref = np.asarray(ref, np.float64)
    np.testing.assert_allclose(actual, ref, rtol=1e-5, atol=1e-6 * max(np.abs(ref).max(), 1e-30))


def dense_stages(devices, balance, params):
    """The MLP's layers (``accel.parallel.layers``) cut by ``balance``, stage s on devices[s]."""
    n = len(params) // 2
    layers = [(dense if k < n - 1 else linear, params[2 * k:2 * k + 2]) for k in range(n)]
    return pe.layer_stages(layers, balance, devices)


@pytest.fixture(scope="module")
def batch():
    x, y, _ = datasets.regression(32, SIZES[0], SIZES[-1], seed=3)
    return tf.constant(x), tf.constant(y)


def single_device(params, x, y, steps=0):
    vs = [tf.Variable(p) for p in params]
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(y, models.mlp_apply(vs, x)))
        for v, g in zip(vs, tape.gradient(loss, vs), strict=True):
            v.assign_sub(LR * g)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(squared_error(y, models.mlp_apply(vs, x)))
    return float(loss), [g.numpy() for g in tape.gradient(loss, vs)], [v.numpy() for v in vs]


SCHEDULES = {"gpipe": pl.gpipe_schedule, "1f1b": pl.one_f_one_b_schedule}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 8)])
def test_pipeline_equals_single_device(name, p, m, batch, four_devices):
    params = models.mlp_init(SIZES, seed=1)
    schedule = SCHEDULES[name](m, p)
    stages = dense_stages(four_devices[:p], partition.balance_by_count(4, p), params)
    run = pe.run_schedule(stages, schedule, *batch, squared_error, m)
    loss, grads, _ = single_device(params, *batch)
    assert_close(run.loss, loss)
    for got, want in zip([g for stage in run.grads for g in stage], grads, strict=True):
        assert_close(got.numpy(), want)
    assert run.orders() == pl.stage_orders(schedule, p)  # recorded as it ran
    expected = [m] * p if name == "gpipe" else [min(p - j, m) for j in range(p)]
    assert run.peak_stash == expected
    for s, stage in enumerate(stages):  # each stage's variables live on its device
        assert {v.device.split("/")[-1] for v in stage.params} == {four_devices[s].split("/")[-1]}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_weights_after_three_steps_and_recompute(name, batch, four_devices):
    params = models.mlp_init(SIZES, seed=2)
    for recompute in (False, True):
        stages = dense_stages(four_devices[:2], [3, 1], params)
        step = pe.make_pipeline_step(stages, squared_error, LR, SCHEDULES[name](4, 2), 4,
                                     recompute=recompute)
        for _ in range(3):
            step(*batch)
        _, _, weights = single_device(params, *batch, steps=3)
        for got, want in zip([v.numpy() for st in stages for v in st.params], weights,
                             strict=True):
            assert_close(got, want)


def test_a_keras_optimizer_with_momentum_equals_one_device(batch, four_devices):
    """One Keras optimizer for all stages: built on every stage's variables, stepped once per
    batch; against Keras' own SGD with momentum on one device."""
    params = models.mlp_init(SIZES, seed=5)
    stages = dense_stages(four_devices[:2], [2, 2], params)
    step = pe.make_pipeline_step(stages, squared_error, tf.keras.optimizers.SGD(LR, momentum=0.9),
                                 pl.one_f_one_b_schedule(4, 2), 4)
    ref = [tf.Variable(p) for p in params]
    opt = tf.keras.optimizers.SGD(LR, momentum=0.9)
    for _ in range(3):
        step(*batch)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(batch[1], models.mlp_apply(ref, batch[0])))
        opt.apply_gradients(zip(tape.gradient(loss, ref), ref, strict=True))
    for got, want in zip([v.numpy() for st in stages for v in st.params], ref, strict=True):
        assert_close(got, want.numpy())


def test_any_schedule_in_the_format_runs(batch, four_devices):
    """A reader's own schedule: stage 0 in GPipe order, stage 1 in 1F1B order."""
    params = models.mlp_init(SIZES, seed=4)
    schedule = pl.clock_schedule([pl.gpipe_orders(4, 2)[0], pl.one_f_one_b_orders(4, 2)[1]])
    run = pe.run_schedule(dense_stages(four_devices[:2], [2, 2], params), schedule, *batch,
                          squared_error, 4)
    _, grads, _ = single_device(params, *batch)
    for got, want in zip([g for stage in run.grads for g in stage], grads, strict=True):
        assert_close(got.numpy(), want)
    assert run.orders() == pl.stage_orders(schedule, 2)


def test_measured_idle_fractions_from_a_written_log():
    task = (0, 0, "F")
    run = pe.PipelineRun(0.0, [], log=[[(task, 0.0, 2.0), (task, 3.0, 4.0)],
                                       [(task, 1.0, 4.0)]])
    assert pe.measured_idle_fractions(run) == pytest.approx([0.25, 0.25])
    with pytest.raises(ValueError, match="the logs hold no task"):
        pe.measured_idle_fractions(pe.PipelineRun(0.0, [], log=[[], []]))
    ticks = itertools.count()  # one stage, one thread: every task takes one tick of this clock
    clocked = pe.run_schedule(dense_stages(["/cpu:0"], [4], models.mlp_init(SIZES)),
                              pl.gpipe_schedule(2, 1), tf.ones((4, 8)), tf.ones((4, 1)),
                              squared_error, 2, clock=lambda: float(next(ticks)))
    assert [(start, end) for _, start, end in clocked.log[0]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert pe.measured_idle_fractions(clocked) == pytest.approx([3 / 7])


def test_bad_input_is_refused_before_running(batch, four_devices):
    stages = dense_stages(four_devices[:2], [2, 2], models.mlp_init(SIZES))
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1, got 0"):
        pe.run_schedule(stages, pl.gpipe_schedule(1, 2), *batch, squared_error, 0)
    with pytest.raises(ValueError, match="a batch of 32 examples .* does not split into 5"):
        pe.run_schedule(stages, pl.gpipe_schedule(5, 2), *batch, squared_error, 5)
    backwards_first = [[(1, 0, "B")], [(1, 0, "F")], [(0, 0, "F")], [(0, 0, "B")]]
    with pytest.raises(ValueError, match=r"task \(1, 0, 'B'\) at tick 0 runs before"):
        pe.run_schedule(stages, backwards_first, *batch, squared_error, 1)
    with pytest.raises(ValueError, match=r"the schedule drops task \(1, 0, 'F'\)"):
        pe.run_schedule(stages, pl.gpipe_schedule(2, 1), *batch, squared_error, 2)
    with pytest.raises(ValueError, match="stages is empty"):
        pe.run_schedule([], pl.gpipe_schedule(1, 1), *batch, squared_error, 1)
    bad = [pe.Stage(stages[0].fn, stages[0].params, "/gpu:x")]
    with pytest.raises(ValueError, match="cannot parse 'gpu:x'"):
        pe.run_schedule(bad, pl.gpipe_schedule(1, 1), *batch, squared_error, 1)


def test_a_failing_stage_is_reported_and_no_thread_is_left(batch, four_devices):
    stages = dense_stages(four_devices[:2], [2, 2], models.mlp_init(SIZES))

    def broken(p, x):
        raise RuntimeError("stage exploded")

    stages[1] = pe.Stage(broken, stages[1].params, stages[1].device)
    with pytest.raises(RuntimeError, match="stage exploded") as info:
        pe.run_schedule(stages, pl.gpipe_schedule(4, 2), *batch, squared_error, 4)
    assert any("pipeline stage 1" in note for note in info.value.__notes__)
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-")]


def test_more_stages_than_layers_or_devices(four_devices):
    params = models.mlp_init(SIZES)
    with pytest.raises(ValueError, match="3 stages need 3 devices, got 2"):
        dense_stages(four_devices[:2], [2, 1, 1], params)
    with pytest.raises(ValueError, match=r"balance \[2, 2, 1\] adds up to 5 layers, but the "
                                         "model has 4"):
        dense_stages(four_devices, [2, 2, 1], params)
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 parts"):
        partition.balance_by_count(4, 5)


# ---------------------------------------------------------------------- ZB-H1: B and W split
def assert_w_after_b(run):
    """Every W task started after its own B ended, on the device that ran both."""
    end = {task: e for log in run.log for task, _, e in log}
    ws = [(task, start) for log in run.log for task, start, _ in log if task[2] == "W"]
    assert ws and all(start >= end[(s, i, "B")] for (s, i, _), start in ws)


@pytest.mark.parametrize("p, m, recompute", [(2, 4, False), (2, 4, True), (4, 8, False)])
def test_zb_h1_equals_single_device(p, m, recompute, batch, four_devices):
    """B (input gradients) and W (weight gradients) as separate tasks: the loss and every
    gradient equal one device's; each device ran the schedule's order, W after its B; each
    stage held p micro-batches at its peak (released at W)."""
    params = models.mlp_init(SIZES, seed=6)
    schedule = pl.zb_h1_schedule(m, p)
    stages = dense_stages(four_devices[:p], partition.balance_by_count(4, p), params)
    run = pe.run_schedule(stages, schedule, *batch, squared_error, m, recompute=recompute)
    loss, grads, _ = single_device(params, *batch)
    assert_close(run.loss, loss)
    for got, want in zip([g for stage in run.grads for g in stage], grads, strict=True):
        assert_close(got.numpy(), want)
    assert run.orders() == pl.stage_orders(schedule, p)
    assert_w_after_b(run)
    assert run.peak_stash == pl.peak_in_flight(schedule, p) == [p] * p


def assert_keras_form_equals_fit(z, devices, schedule, **options):
    """``Pipeline(..., schedule=schedule)`` on the Keras MLP, 4 micro-batches: the first step's
    loss and gradients equal one device's, each device ran the schedule's order (W after B
    where it has W tasks),
    and the weights after three Adam steps equal Keras's ``fit``'s. Returns the form."""
    model = z.MODELS["mlp"]()
    x, y = z.data_for(model)
    ref, _ = z.keras_fit(model, z.OPTIMIZERS["adam"](), x, y)
    pipe = pe.Pipeline(model, devices, loss="mse", optimizer=z.OPTIMIZERS["adam"](),
                       num_microbatches=4, schedule=schedule, **options)
    loss0, grads0 = z.first_gradients(model, x, y)
    run = pipe.run_step(x[:z.BATCH], y[:z.BATCH])
    z.assert_close(run.loss, loss0, "first loss")
    z.assert_close(z.flat(sum(run.grads, [])), z.flat(grads0), "first gradients")
    assert run.orders() == pl.device_orders(pl.make_schedule(schedule, 4, len(devices)),
                                            len(devices), pl.SCHEDULE_PLACEMENT[schedule])
    if pl.splits_backward(run.orders()):
        assert_w_after_b(run)
    for k in range(1, z.STEPS):
        pipe.run_step(x[k * z.BATCH:(k + 1) * z.BATCH], y[k * z.BATCH:(k + 1) * z.BATCH])
    pipe.write_back()
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i} after {z.STEPS} steps", scale)
    return pipe


def test_zb_h1_steps_and_keras_form_equal_one_device(batch, four_devices, keras_zoo):
    """make_pipeline_step with ZB-H1 for three SGD steps, and the Keras form
    ``Pipeline(..., schedule="zb-h1")`` for three Adam steps against Keras's ``fit``."""
    params = models.mlp_init(SIZES, seed=7)
    stages = dense_stages(four_devices[:2], [2, 2], params)
    step = pe.make_pipeline_step(stages, squared_error, LR, pl.zb_h1_schedule(4, 2), 4)
    for _ in range(3):
        step(*batch)
    _, _, weights = single_device(params, *batch, steps=3)
    for got, want in zip([v.numpy() for st in stages for v in st.params], weights, strict=True):
        assert_close(got, want)

    assert_keras_form_equals_fit(keras_zoo, four_devices[:2], "zb-h1")


# ---------------------------------------------------------------------- ZB-V: stages as a V
@pytest.mark.parametrize("m, recompute", [(4, False), (2, True)])
def test_zb_v_on_two_devices_equals_single_device(m, recompute, batch, four_devices):
    """Four chunks on two devices placed as a V (stages 0 and 3 on the first, 1 and 2 on the
    second): the loss and every gradient equal one device's; each device ran the schedule's
    order for that placement, W after its B; the stash per stage is the schedule's."""
    params = models.mlp_init(SIZES, seed=8)
    d0, d1 = four_devices[:2]
    stages = dense_stages([d0, d1, d1, d0], [1, 1, 1, 1], params)
    assert pe.stage_placement(stages) == ([d0, d1], "v")
    schedule = pl.zb_v_schedule(m, 2)
    run = pe.run_schedule(stages, schedule, *batch, squared_error, m, recompute=recompute)
    loss, grads, _ = single_device(params, *batch)
    assert_close(run.loss, loss)
    for got, want in zip([g for stage in run.grads for g in stage], grads, strict=True):
        assert_close(got.numpy(), want)
    assert run.orders() == pl.device_orders(schedule, 2, placement="v") == pl.zb_v_orders(m, 2)
    assert_w_after_b(run)
    assert run.peak_stash == pl.peak_in_flight(schedule, 4)
    for s, stage in enumerate(stages):  # stage s's variables on the device of the V
        want = [d0, d1][pl.v_shape_device(s, 2)].split("/")[-1]
        assert {v.device.split("/")[-1] for v in stage.params} == {want}


def test_zb_v_refused_on_a_loop_placement_and_bad_placements(batch, four_devices):
    """ZB-V's ticks on stages placed round-robin would run two tasks on one device at once:
    refused before anything runs, as is a placement that is neither a loop nor a V."""
    d0, d1 = four_devices[:2]
    params = models.mlp_init(SIZES)
    loop = dense_stages([d0, d1, d0, d1], [1, 1, 1, 1], params)
    with pytest.raises(ValueError, match="a device runs two tasks at once"):
        pe.run_schedule(loop, pl.zb_v_schedule(4, 2), *batch, squared_error, 4)
    neither = dense_stages([d0, d1, d0, d0], [1, 1, 1, 1], params)
    with pytest.raises(ValueError, match="give one device per stage, 2 devices repeated"):
        pe.stage_devices(neither)


def test_zb_v_keras_form_equals_one_device(four_devices, keras_zoo):
    """``Pipeline(..., schedule="zb-v")``: four chunks of the Keras MLP on two devices as a V,
    three Adam steps against Keras's ``fit``; the first step's loss and gradients against one
    device's."""
    pipe = assert_keras_form_equals_fit(keras_zoo, four_devices[:2], "zb-v", num_chunks=2)
    assert (pipe.num_chunks, pipe.placement) == (2, "v")
    assert [st.device for st in pipe.stages] == [four_devices[k] for k in (0, 1, 1, 0)]
    assert pipe.last_run.orders() == pl.zb_v_orders(4, 2)
    with pytest.raises(ValueError, match="num_chunks=1: 'zb-v' puts 2 chunks on each device"):
        pe.Pipeline(pipe.model, four_devices[:2], loss="mse", optimizer="sgd",
                    num_microbatches=4, schedule="zb-v", num_chunks=1)


def test_concrete_function_keys_tell_structures_and_specs_apart():
    """The key a traced stage's concrete function is kept under (pe._spec_key): a tensor and a
    one-tuple of it, a tuple and a list, other shapes, dtypes and IndexedSlices row counts all
    get their own; the same structure and specs the same key."""
    x = tf.ones((4, 3))
    rows = [tf.IndexedSlices(tf.ones((k, 3)), tf.range(k), tf.constant([9, 3])) for k in (2, 5)]
    args = [x, (x,), [x], tf.ones((5, 3)), tf.ones((4, 3), tf.float64), rows[0], rows[1], None]
    keys = [pe._spec_key(a) for a in args]
    assert len(set(keys)) == len(args)
    assert pe._spec_key((tf.zeros((4, 3)), None)) == pe._spec_key((x, None))


class _Traced:
    traced = True


@pytest.mark.parametrize("name,v,recompute,expected", [
    ("1f1b", 1, False, {(1, 0), (1, 1), (1, 2), (1, 3)}),  # B right after F on the last stage
    ("gpipe", 1, False, {(1, 3)}),  # only the last micro-batch's F is followed by its B
    ("gpipe", 1, True, {(1, 0), (1, 1), (1, 2), (1, 3)}),  # its backward recomputes anyway
    ("interleaved", 2, False, {(3, 0), (3, 1), (3, 2), (3, 3)}),
    ("zb-h1", 1, False, set()),  # W tasks need the forward's tape
])
def test_which_forwards_run_inside_their_backward(name, v, recompute, expected):
    """pe.deferred_forwards on 2 devices, 4 micro-batches, against a table written by hand from
    each schedule's device orders; a stage that is not traced defers nothing."""
    schedule = pl.make_schedule(name, 4, 2, v)
    orders = pl.device_orders(schedule, 2, "loop")
    assert pe.deferred_forwards([_Traced()] * (2 * v), orders, recompute) == expected
    untraced = [pe.Stage(None, [], "/cpu:0")] * (2 * v)
    assert pe.deferred_forwards(untraced, orders, recompute) == set()


@pytest.mark.parametrize("schedule,deferred", [("1f1b", {(1, 0), (1, 1), (1, 2), (1, 3)}),
                                               ("gpipe", {(1, 3)})])
def test_the_keras_form_runs_deferred_forwards_and_equals_fit(schedule, deferred, four_devices,
                                                              keras_zoo):
    """On the Keras MLP the last stage's forwards that the table above defers ran inside their
    backward (``last_run.deferred``), and the form still equals one device and Keras's ``fit``
    (GPipe: one deferred forward beside three taped ones, in one step's sums)."""
    pipe = assert_keras_form_equals_fit(keras_zoo, four_devices[:2], schedule)
    assert pipe.last_run.deferred == deferred
