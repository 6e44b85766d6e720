"""The mixture-of-experts layer: the routing rule against tables worked out by hand, the layer
with experts on several devices against the same layer on one device (forward and gradients),
and the load-balancing loss lowering the imbalance."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.parallel import moe


def test_route_top1_by_hand():
    probs = np.array([[.9, .1], [.8, .2], [.7, .3], [.6, .4], [.2, .8], [.55, .45]])
    cap = moe.capacity_of(6, 2, 1, 1.0)
    assert cap == 3
    r = moe.route(probs, 1, cap)
    assert r.expert.ravel().tolist() == [0, 0, 0, 0, 1, 0]
    assert r.slot.ravel().tolist() == [0, 1, 2, -1, 0, -1]
    assert r.dropped == 2
    assert r.load(2).tolist() == [5, 1]
    assert moe.load_imbalance(r, 2) == pytest.approx(5 * 2 / 6)


def test_route_top2_by_hand():
    probs = np.array([[.5, .3, .2], [.6, .1, .3], [.4, .35, .25], [.2, .5, .3]])
    r = moe.route(probs, 2, 2)
    assert r.expert.tolist() == [[0, 1], [0, 2], [0, 1], [1, 2]]
    # first choices first: t2's first choice finds expert 0 full; then t2's second finds 1 full
    assert r.slot.tolist() == [[0, 1], [1, 0], [-1, -1], [0, 1]]
    assert r.dropped == 2
    assert moe.capacity_of(8, 4, 2, 1.25) == 5  # ceil(1.25 * 2 * 8 / 4)


def _problem(n_experts=4, d=6, h=8, tokens=16, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, d)).astype(dtype)
    gate = rng.normal(size=(d, n_experts)).astype(dtype)
    experts = [(rng.normal(size=(d, h)).astype(dtype) / 3,
                rng.normal(size=(h, d)).astype(dtype) / 3) for _ in range(n_experts)]
    return x, gate, experts


@pytest.mark.parametrize("k, factor", [(1, 1.0), (2, 1.0), (1, 2.0), (2, 0.5)])
@pytest.mark.parametrize("n", [2, 4])
def test_sharded_equals_one_device(four_devices, k, factor, n):
    devs = four_devices[:n]
    x, gate, experts = _problem()
    per = len(experts) // n
    with tf.device(devs[0]):
        g_ref = tf.Variable(gate)
        e_ref = [(tf.Variable(a), tf.Variable(b)) for a, b in experts]
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        with tf.device(devs[0]):
            y_ref, r_ref = moe.moe_layer(xt, g_ref, e_ref, k, factor, groups=n)
        loss = tf.reduce_sum(tf.sin(y_ref))
    ref_grads = tape.gradient(loss, [xt, g_ref] + [w for e in e_ref for w in e])

    g_var = tf.Variable(gate)
    e_vars = []
    for e, (a, b) in enumerate(experts):
        with tf.device(devs[e // per]):
            e_vars.append((tf.Variable(a), tf.Variable(b)))
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        xs = collectives.place(tf.split(xt, n), devs)
        ys, routings = moe.moe_layer_sharded(xs, g_var, e_vars, devs, k, factor)
        loss = tf.add_n([tf.reduce_sum(tf.sin(y)) for y in ys])
    grads = tape.gradient(loss, [xt, g_var] + [w for e in e_vars for w in e])
    np.testing.assert_allclose(tf.concat(ys, 0).numpy(), y_ref.numpy(), rtol=1e-10, atol=1e-12)
    assert [r.dropped for r in routings] == [r.dropped for r in r_ref]
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)
    if factor == 0.5:
        assert sum(r.dropped for r in routings) > 0


def test_dropped_token_gets_zero_output():
    x = tf.constant([[1.0], [1.0], [1.0]])
    gate = tf.constant([[2.0, 0.0]])  # every token prefers expert 0
    experts = [(tf.ones((1, 1)), tf.ones((1, 1)))] * 2
    y, (r,) = moe.moe_layer(x, gate, experts, k=1, capacity_factor=2 / 3)  # capacity 1
    assert r.slot.ravel().tolist() == [0, -1, -1]
    p0 = np.exp(2) / (np.exp(2) + 1)
    np.testing.assert_allclose(y.numpy().ravel(), [p0, 0, 0], rtol=1e-6)


def test_load_balancing_loss_evens_the_load():
    x, gate, _ = _problem(tokens=256, seed=2, dtype=np.float32)
    x[:, 0] = 1.0
    gate[0, 0] += 6.0  # a gate that sends most tokens to expert 0
    g = tf.Variable(gate)
    before = moe.load_imbalance(moe.route(tf.nn.softmax(x @ gate).numpy(), 1, 256), 4)
    opt = tf.keras.optimizers.SGD(0.5)
    for _ in range(30):
        with tf.GradientTape() as tape:
            probs = tf.nn.softmax(tf.matmul(x, g))
            aux = moe.load_balancing_loss(probs, tf.argmax(probs, 1), 4)
        opt.apply_gradients([(tape.gradient(aux, g), g)])
    after = moe.load_imbalance(moe.route(tf.nn.softmax(x @ g.numpy()).numpy(), 1, 256), 4)
    assert before > 2.0 and after < before / 1.5
    # uniform probabilities and loads: the loss is exactly 1
    uniform = tf.fill([8, 4], 0.25)
    assert float(moe.load_balancing_loss(uniform, tf.constant([0, 1, 2, 3] * 2), 4)) == 1.0


def test_bad_input(four_devices):
    x, gate, experts = _problem()
    with pytest.raises(ValueError, match="k must be one of"):
        moe.route(np.ones((2, 2)), 3, 1)
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        moe.route(np.ones((2, 2)), 1, 0)
    with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
        moe.capacity_of(4, 2, 1, 0.0)
    with pytest.raises(ValueError, match="3 experts do not split over 2 devices"):
        moe.moe_layer_sharded([x[:8], x[8:]], gate[:, :3], experts[:3], four_devices[:2])
    with pytest.raises(ValueError, match="top-2 routing needs at least 2 experts"):
        moe.moe_layer(tf.constant(x), gate[:, :1], experts[:1], k=2)
