"""Routing beyond a capacity and experts over EP x DP (``accel.parallel.moe``), each against a
reference written token by token (or expert by expert) in plain TensorFlow ops without any of
``moe``'s routing code, forward and gradients; the layout and the counts against tables worked
out by hand."""

import math
from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.parallel import moe


def _problem(n_experts=4, d=6, h=8, tokens=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, d))
    gate = rng.normal(size=(d, n_experts))
    experts = [(rng.normal(size=(d, h)) / 3, rng.normal(size=(h, d)) / 3)
               for _ in range(n_experts)]
    return x, gate, experts


def _expert_out(xt, w1, w2):
    hidden = tf.nn.relu(tf.linalg.matvec(w1, xt, transpose_a=True))
    return tf.linalg.matvec(w2, hidden, transpose_a=True)


def reference_dropless(x, gate, experts, k, bias=None):
    """Token by token: the k experts with the largest ``p + bias`` (ties: lower index), each
    output weighted by the token's unbiased probability, renormalised over the k for k > 1.
    Returns ``(y, chosen experts per token)``."""
    num = len(experts)
    b = np.zeros(num) if bias is None else np.asarray(bias, np.float64)
    rows, chosen = [], []
    for t in range(int(x.shape[0])):
        p = tf.nn.softmax(tf.linalg.matvec(gate, x[t], transpose_a=True))
        best = sorted(range(num), key=lambda e, p=p: (-(float(p[e]) + b[e]), e))[:k]
        norm = tf.add_n([p[e] for e in best]) if k > 1 else 1.0
        rows.append(tf.add_n([p[e] / norm * _expert_out(x[t], *experts[e]) for e in best]))
        chosen.append(best)
    return tf.stack(rows), chosen


def reference_expert_choice(x, gate, experts, factor):
    """Expert by expert: each takes the ``ceil(factor T / E)`` tokens of highest probability
    (ties: lower token), its output for token t weighted by p[t, e]."""
    tokens, num = int(x.shape[0]), len(experts)
    cap = math.ceil(Fraction(str(factor)) * tokens / num)
    probs = [tf.nn.softmax(tf.linalg.matvec(gate, x[t], transpose_a=True)) for t in range(tokens)]
    out = [tf.zeros_like(x[t]) for t in range(tokens)]
    picked = []
    for e in range(num):
        best = sorted(range(tokens), key=lambda t, e=e: (-float(probs[t][e]), t))[:cap]
        for t in best:
            out[t] = out[t] + probs[t][e] * _expert_out(x[t], *experts[e])
        picked.append(best)
    return tf.stack(out), picked


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k, bias", [(1, None), (2, None), (2, [0.3, -0.2, 0.0, 0.1]),
                                     (3, [-0.5, 0.5, 0.0, 0.0])])
def test_dropless_layer_equals_the_token_by_token_reference(four_devices, moe_run, k, bias):
    x, gate, experts = _problem()
    g, es = moe_run.variables(gate, experts, four_devices)
    want_y, want_chosen, want_grads = moe_run.run(
        lambda xt, g, es: reference_dropless(xt, g, es, k, bias), x, g, es)
    got_y, got_chosen, got_grads = moe_run.run(
        lambda xt, g, es: moe.dropless_layer(xt, g, es, k, bias)[:2], x, g, es)
    _close(got_y, want_y)
    assert got_chosen.numpy().tolist() == want_chosen
    for a, b in zip(got_grads, want_grads, strict=True):
        _close(a.numpy(), b.numpy())


@pytest.mark.parametrize("n, k, bias", [(2, 1, None), (4, 2, None), (4, 2, [0.2, 0, 0, -0.2])])
def test_dropless_sharded_equals_the_reference_and_counts_its_bytes(four_devices, moe_run, n, k,
                                                                   bias):
    devs = four_devices[:n]
    x, gate, experts = _problem()
    g, es = moe_run.variables(gate, experts, devs)
    want_y, want_chosen, want_grads = moe_run.run(
        lambda xt, g, es: reference_dropless(xt, g, es, k, bias), x, g, es)

    def sharded(xt, g, es):
        ys, chosen, sent = moe.dropless_sharded(tf.split(xt, n), g, es, devs, k, bias)
        return tf.concat(ys, 0), (chosen, sent)

    got_y, (chosen, sent), got_grads = moe_run.run(sharded, x, g, es)
    _close(got_y, want_y)
    assert np.concatenate([c.numpy() for c in chosen]).tolist() == want_chosen
    for a, b in zip(got_grads, want_grads, strict=True):
        _close(a.numpy(), b.numpy())
    # by hand: a choice of device i's token for an expert of device j != i sends one row
    per_dev, per_exp = len(x) // n, len(experts) // n
    hand = np.zeros((n, n), dtype=np.int64)
    for t, best in enumerate(want_chosen):
        for e in best:
            i, j = t // per_dev, e // per_exp
            if i != j:
                hand[i, j] += x.shape[1] * 8  # float64 row
    assert np.array_equal(sent, hand)
    assert sent.sum() > 0


@pytest.mark.parametrize("factor", [1.0, 0.5, 2.0])
def test_expert_choice_equals_the_expert_by_expert_reference(four_devices, moe_run, factor):
    x, gate, experts = _problem()
    g, es = moe_run.variables(gate, experts, four_devices)
    want_y, want_picked, want_grads = moe_run.run(
        lambda xt, g, es: reference_expert_choice(xt, g, es, factor), x, g, es)
    got_y, got_picked, got_grads = moe_run.run(
        lambda xt, g, es: moe.expert_choice_layer(xt, g, es, factor), x, g, es)
    _close(got_y, want_y)
    assert got_picked.numpy().tolist() == want_picked
    assert {len(p) for p in want_picked} == {math.ceil(factor * 16 / 4)}  # perfectly even
    for a, b in zip(got_grads, want_grads, strict=True):
        _close(a.numpy(), b.numpy())


def test_router_z_loss_against_its_formula_and_gradient():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 4)) * 3
    lse = np.log(np.exp(logits).sum(1))
    z = tf.Variable(logits)
    with tf.GradientTape() as tape:
        loss = moe.router_z_loss(z)
    np.testing.assert_allclose(float(loss), np.mean(lse ** 2), rtol=1e-12)
    soft = np.exp(logits - lse[:, None])
    np.testing.assert_allclose(tape.gradient(loss, z).numpy(), 2 * lse[:, None] * soft / 5,
                               rtol=1e-10)
    shifted = float(moe.router_z_loss(tf.constant(logits + 10.0)))
    np.testing.assert_allclose(shifted, np.mean((lse + 10) ** 2), rtol=1e-12)  # not shift-free


def test_top_k_route_and_the_bias_by_hand():
    probs = tf.constant([[.9, .1], [.8, .2], [.7, .3], [.6, .4], [.2, .8], [.55, .45]],
                        tf.float64)
    expert, w = moe.top_k_route(probs, 1)
    assert expert[:, 0].numpy().tolist() == [0, 0, 0, 0, 1, 0]
    expert, w = moe.top_k_route(probs, 1, bias=[-0.15, 0.15])
    assert expert[:, 0].numpy().tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(w[:, 0], [.9, .8, .7, .4, .8, .45])  # unbiased probabilities
    tie, _ = moe.top_k_route(tf.constant([[.25] * 4]), 2)
    assert tie.numpy().tolist() == [[0, 1]]  # ties go to the lower index
    _, w2 = moe.top_k_route(tf.constant([[.5, .3, .2]]), 2)
    np.testing.assert_allclose(w2.numpy(), [[.625, .375]])


def test_update_bias_and_expert_load_by_hand():
    np.testing.assert_allclose(moe.update_bias(np.zeros(4), [5, 1, 1, 1], 0.1),
                               [-0.1, 0.1, 0.1, 0.1])
    np.testing.assert_allclose(moe.update_bias([0.5, 0.0], [2, 2], 0.1), [0.5, 0.0])  # even
    assert moe.expert_load([[0, 2], [2, 2]], 4).tolist() == [1, 0, 3, 0]


def test_layout_by_hand(four_devices):
    lay = moe.expert_layout(8, four_devices, ep=2)
    assert lay.dp == 2 and lay.per_device == 4
    assert [lay.experts_on(i) for i in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert [lay.ep_group(i) for i in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [lay.expert_dp_group(i) for i in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [lay.device_of(5, s) for s in range(4)] == [1, 1, 3, 3]
    full = moe.expert_layout(4, four_devices, ep=4)
    assert full.dp == 1 and [full.device_of(e, 2) for e in range(4)] == [0, 1, 2, 3]


def test_token_matrix_by_hand(four_devices):
    lay = moe.expert_layout(4, four_devices, ep=2)
    experts = [np.array([[0, 3]]), np.array([[2, 2]]), np.array([[1, 3]]), np.array([[0, 0]])]
    kept = [np.array([[True, True]]), np.array([[True, False]]), np.array([[True, True]]),
            np.array([[False, True]])]
    assert moe.token_matrix(experts, lay).tolist() == [[1, 1, 0, 0], [0, 2, 0, 0],
                                                       [0, 0, 1, 1], [0, 0, 2, 0]]
    assert moe.token_matrix(experts, lay, kept).tolist() == [[1, 1, 0, 0], [0, 1, 0, 0],
                                                             [0, 0, 1, 1], [0, 0, 1, 0]]


@pytest.mark.parametrize("ep, k", [(2, 2), (2, 1), (4, 2)])
def test_ep_dp_equals_one_device(four_devices, ep, k):
    """Outputs as the one-device layer on the same groups (itself checked against a token-by-
    token reference in test_moe.py); each expert's gradient summed over its copies equals one
    device's; no token crosses an EP group."""
    x, gate, experts = _problem(tokens=32)
    lay = moe.expert_layout(4, four_devices, ep)
    replicas = moe.place_experts(experts, lay)
    one = [(tf.Variable(a), tf.Variable(b)) for a, b in experts]
    g = tf.Variable(gate)
    with tf.GradientTape(persistent=True) as tape:
        ys, routings = moe.moe_layer_ep_dp(tf.split(tf.constant(x), 4), g, replicas, lay, k, 1.0)
        y_one, r_one = moe.moe_layer(tf.constant(x), g, one, k, 1.0, groups=4)
        l_ep, l_one = (tf.reduce_sum(tf.sin(v)) for v in (tf.concat(ys, 0), y_one))
    _close(tf.concat(ys, 0).numpy(), y_one.numpy())
    assert [r.dropped for r in routings] == [r.dropped for r in r_one]
    g_ep = tape.gradient(l_ep, [w for c in replicas for p in c for w in p])
    g_one = tape.gradient(l_one, [w for p in one for w in p])
    per = len(g_one)
    for i in range(per):
        total = collectives.all_reduce([g_ep[c * per + i] for c in range(lay.dp)],
                                       [four_devices[j] for j in
                                        lay.expert_dp_group(lay.device_of(i // 2, 0))])[0]
        _close(total.numpy(), g_one[i].numpy())
    _close(tape.gradient(l_ep, g).numpy(), tape.gradient(l_one, g).numpy())
    m = moe.token_matrix([r.expert for r in routings], lay)
    for i in range(4):
        outside = [j for j in range(4) if j not in lay.ep_group(i)]
        assert m[i, outside].sum() == 0
    assert replicas[-1][-1][0].device.endswith(four_devices[lay.device_of(3, 4 - ep)][-5:])


def test_bad_input(four_devices):
    x, gate, experts = _problem()
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 devices"):
        moe.expert_layout(6, four_devices, 3)
    with pytest.raises(ValueError, match="3 experts do not split over ep=2"):
        moe.expert_layout(3, four_devices, 2)
    with pytest.raises(ValueError, match="top-5 routing needs at least 5 experts"):
        moe.top_k_route(tf.ones((2, 4)), 5)
    with pytest.raises(ValueError, match="bias must have one value per expert"):
        moe.top_k_route(tf.ones((2, 4)), 1, bias=[0.0, 0.0])
    with pytest.raises(ValueError, match="rate must be a number >= 0"):
        moe.update_bias([0.0], [1], -0.1)
    with pytest.raises(ValueError, match="one value per expert"):
        moe.update_bias([0.0, 0.0], [1], 0.1)
    with pytest.raises(ValueError, match="expert indices must lie in 0..3"):
        moe.expert_load([4], 4)
    with pytest.raises(ValueError, match="logits must be"):
        moe.router_z_loss(tf.ones(3))
    with pytest.raises(ValueError, match="at most 4"):
        moe.expert_choice_layer(tf.constant(x), tf.constant(gate), experts, 5.0)
    with pytest.raises(ValueError, match="gate_w scores 4 experts, got 3"):
        moe.dropless_layer(tf.constant(x), tf.constant(gate), experts[:3])
    with pytest.raises(ValueError, match="4 experts do not split over 3 devices"):
        moe.dropless_sharded(np.split(x, 4)[:3], gate, experts, four_devices[:3])
    with pytest.raises(ValueError, match="got 2 token groups for 4 devices"):
        moe.dropless_sharded(np.split(x, 2), gate, experts, four_devices)
    lay = moe.expert_layout(4, four_devices, 2)
    with pytest.raises(ValueError, match="got 3 experts for a layout of 4"):
        moe.place_experts(experts[:3], lay)
    with pytest.raises(ValueError, match="one array of chosen experts"):
        moe.token_matrix([np.array([0])], lay)
