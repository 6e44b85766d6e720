"""accel.parallel.model (and accel.parallel.layers): a split step equals the one-device step;
placement and the bytes crossing are checked against hand counts."""

import numpy as np
import pytest
import tensorflow as tf

from accel import models, placement
from accel.parallel import model as mp
from accel.parallel import trace
from accel.parallel.data import make_single_step
from accel.training import squared_error

SIZES = [8, 16, 16, 16, 16, 4]
BATCH, LR = 32, 0.1


def dense(params, x):
    return tf.nn.relu(x @ params[0] + params[1])


def linear(params, x):
    return x @ params[0] + params[1]


def mlp_layers():
    arr = models.mlp_init(SIZES)
    return arr, [(dense if i < 4 else linear, arr[2 * i:2 * i + 2]) for i in range(5)]


def batch():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(BATCH, 8)).astype(np.float32),
            rng.normal(size=(BATCH, 4)).astype(np.float32))


def close(actual, ref):
    ref = np.asarray(ref)
    np.testing.assert_allclose(actual, ref, rtol=1e-5, atol=1e-6 * np.max(np.abs(ref)))


def reference_gradients(arrays, x, y):
    params = [tf.Variable(a) for a in arrays]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(squared_error(y, models.mlp_apply(params, x)))
    return loss, tape.gradient(loss, params)


@pytest.mark.parametrize("n", [2, 4])
def test_split_step_equals_single_device(four_devices, n):
    arrays, layers = mlp_layers()
    x, y = batch()
    step = mp.make_split_step(mp.split(layers, four_devices[:n], [8]), squared_error, LR)
    ref = make_single_step(models.mlp_apply, squared_error, arrays, LR, four_devices[0])
    close(step.model(x), models.mlp_apply(arrays, x))
    loss, grads = step.gradients(x, y)
    ref_loss, ref_grads = reference_gradients(arrays, x, y)
    close(loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        close(g, r)
    for _ in range(3):
        close(step(x, y), ref(x, y))
    for v, r in zip(step.model.variables(), ref.variables, strict=True):
        close(v, r)


def test_keras_layers_split(four_devices):
    x, y = batch()
    layers = [tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(4)]
    part = mp.split(layers, four_devices[:2], [8])
    arrays = [a for s in part.specs for a in s.arrays]
    close(mp.SplitModel(part)(x), models.mlp_apply(arrays, x))  # Keras Dense == the plain MLP
    step = mp.make_split_step(part, squared_error, LR)
    ref = make_single_step(models.mlp_apply, squared_error, arrays, LR, four_devices[0])
    for _ in range(3):
        close(step(x, y), ref(x, y))
    for v, r in zip(step.model.variables(), ref.variables, strict=True):
        close(v, r)


def test_tf1_graph_equals_single_device(four_devices):
    arrays, layers = mlp_layers()
    x, y = batch()
    part = mp.split(layers, four_devices, [8])
    g = mp.build_graph(part, squared_error, LR, [BATCH, 8], [BATCH, 4])
    ref = make_single_step(models.mlp_apply, squared_error, arrays, LR, four_devices[0])
    ref_losses = [ref(x, y).numpy() for _ in range(3)]  # eagerly, before the session's graph
    with tf.compat.v1.Session(graph=g.graph, config=placement.session_config()) as sess:
        sess.run(g.init_op)
        for r in ref_losses:
            loss, _ = sess.run([g.loss, g.train_op], {g.x: x, g.y: y})
            close(loss, r)
        weights = sess.run([v for part_vars in g.variables for v in part_vars])
        for name, d in zip(["part_0", "part_1", "part_2", "part_3"], four_devices, strict=True):
            p = placement.placement_of(g.train_op, session=sess, feed_dict={g.x: x, g.y: y})
            ops = [r for r in p.rows if r.name.startswith(name) and r.op_type == "MatMul"]
            assert ops and {r.device for r in ops} == {d}
    for w, r in zip(weights, ref.variables, strict=True):
        close(w, r)


def test_hybrid_two_replicas_two_stages(four_devices):
    arrays, layers = mlp_layers()
    x, y = batch()
    step = mp.make_split_step(mp.split(layers, four_devices[:2], [8]), squared_error, LR,
                              replicas=[four_devices[:2], four_devices[2:]])
    ref = make_single_step(models.mlp_apply, squared_error, arrays, LR, four_devices[0])
    for _ in range(3):
        close(step(x, y), ref(x, y))
    for v, r in zip(step.model.variables(), ref.variables, strict=True):
        close(v, r)
    p = placement.placement_of(step, x, y)
    for r, devs in enumerate([four_devices[:2], four_devices[2:]]):
        for stage, d in enumerate(devs):
            ops = [o for o in p.rows if o.name.startswith(f"r{r}_forward_{stage}/")
                   and o.op_type == "MatMul"]
            assert ops and {o.device for o in ops} == {d}


def test_placement_of_parts_and_variables(four_devices):
    _, layers = mlp_layers()
    x, y = batch()
    part = mp.split(layers, four_devices, [8])
    step = mp.make_split_step(part, squared_error, LR)
    p = placement.placement_of(step, x, y)
    for i, d in enumerate(four_devices):
        # forward ops under r0_forward_i/, their gradients under gradient_tape/r0_forward_i/
        for scope in (f"r0_forward_{i}/", f"gradient_tape/r0_forward_{i}/"):
            ops = [r for r in p.rows if r.name.startswith(scope) and r.op_type == "MatMul"]
            assert ops and {r.device for r in ops} == {d}, scope
        updates = [r for r in p.ops_on(d) if r.op_type == "ResourceApplyGradientDescent"]
        assert len(updates) == 2 * len(part.parts[i].layers)  # a weight and a bias per layer
        for v in step.model.variables(i):
            assert placement.short_device(v.device) == d


def test_transfers_are_the_boundary_activations(four_devices):
    _, layers = mlp_layers()
    x, y = batch()
    d = four_devices
    step = mp.make_split_step(mp.split(layers, d, [8]), squared_error, LR)
    moved = [(t.direction, t.source, t.target, t.nbytes)
             for t in trace.transfers_of(step, x, y) if not t.control]
    act = BATCH * 16 * 4  # a [32, 16] float32 activation, by hand
    expected = [("forward", d[0], d[1], act), ("forward", d[1], d[2], act),
                ("forward", d[2], d[3], act),
                ("forward", d[0], d[3], BATCH * 4 * 4),  # the labels go to the loss
                ("forward", d[3], d[0], 4),  # the scalar loss comes back to the caller
                ("backward", d[1], d[0], act), ("backward", d[2], d[1], act),
                ("backward", d[3], d[2], act)]
    assert sorted(moved) == sorted(expected)
    assert mp.split(layers, d, [8]).boundary_bytes(BATCH) == [act] * 3


def test_tf1_transfers(four_devices):
    _, layers = mlp_layers()
    x, y = batch()
    d = four_devices
    g = mp.build_graph(mp.split(layers, d[:2], [8]), squared_error, LR, [BATCH, 8], [BATCH, 4])
    with tf.compat.v1.Session(graph=g.graph, config=placement.session_config()) as sess:
        sess.run(g.init_op)
        moved = trace.transfers_of(g.train_op, session=sess, feed_dict={g.x: x, g.y: y})
    act = [(t.direction, t.source, t.target, t.nbytes) for t in moved if t.nbytes]
    assert sorted(act) == [("backward", d[1], d[0], BATCH * 16 * 4),
                           ("forward", d[0], d[1], BATCH * 16 * 4)]


def test_balances_and_partition_rows(four_devices):
    _, layers = mlp_layers()
    part = mp.split(layers, four_devices[:2], [8], balance="bytes")
    # parameter bytes per layer: 8*16+16, 16*16+16 (x3), 16*4+4 -> *4 bytes
    assert [s.param_bytes for s in part.specs] == [576, 1088, 1088, 1088, 272]
    assert part.balance == [2, 3] and [p.param_bytes for p in part.parts] == [1664, 2448]
    assert mp.split(layers, four_devices, [8]).balance == [2, 1, 1, 1]
    assert mp.split(layers, four_devices[:2], [8], balance="time",
                    times=[1, 1, 1, 1, 10]).balance == [4, 1]
    assert mp.split(layers, four_devices[:2], [8], balance=[1, 4]).balance == [1, 4]


def test_bad_input(four_devices):
    _, layers = mlp_layers()
    with pytest.raises(ValueError, match="cannot split 5 layers into 6 parts"):
        mp.split(layers, ["/cpu:0"] * 6, [8])
    with pytest.raises(ValueError, match=r"balance \[2, 2\] adds up to 4 layers, but the model "
                                         "has 5"):
        mp.split(layers, four_devices[:2], [8], balance=[2, 2])
    with pytest.raises(ValueError, match="devices is empty"):
        mp.split(layers, [], [8])
    with pytest.raises(ValueError, match="device name '/gpu:x'"):
        mp.split(layers, ["/cpu:0", "/gpu:x"], [8])
    bad = layers[:2] + [(dense, models.mlp_init([12, 16]))] + layers[3:]
    with pytest.raises(ValueError, match=r"layer 2 \(layer_2\) does not take layer 1's output "
                                         r"\(shape \[16\]\)"):
        mp.split(bad, four_devices[:2], [8])
    with pytest.raises(ValueError, match="balance='time' needs times="):
        mp.split(layers, four_devices[:2], [8], balance="time")
