"""Sequence parallelism in accel.parallel.megatron (Korthikanti et al. 2022, section 4.2.2):
``tp_mlp`` / ``tp_block`` with ``sequence_parallel=True`` against the one-device layers (output
reassembled from the sequence shards, gradients of the input and of every parameter), the bytes
each device sends counted in the graph that ran against the formula (and against the ring
all-reduce version), and the activation bytes between the regions against a hand count."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.parallel import megatron as tp

B, S, H, HEADS = 2, 8, 8, 4


def _close(actual, ref):
    """float64; the floor 1e-12 is for bk's gradient, zero in exact arithmetic."""
    ref = np.asarray(ref)
    np.testing.assert_allclose(actual, ref, rtol=1e-5,
                               atol=max(1e-6 * np.max(np.abs(ref)), 1e-12))


def _where(device):
    spec = tf.DeviceSpec.from_string(device)
    return spec.device_type.upper(), spec.device_index


def _setup(kind, n, seed=0):
    params = tp.init_block(H, HEADS, seed=seed, dtype=np.float64)
    if kind == "mlp":
        params = {k: params[k] for k in ("w1", "b1", "w2", "b2")}
    rng = np.random.default_rng(seed + 1)
    return params, rng.standard_normal((B, S, H)), rng.standard_normal((B, S, H))


def _one(kind):
    return tp.mlp if kind == "mlp" else (lambda p, x: tp.block(p, x, HEADS))


def _many(kind, sequence_parallel, algorithm="direct"):
    if kind == "mlp":
        return lambda s, xs, d: tp.tp_mlp(s, xs, d, sequence_parallel, algorithm)
    return lambda s, xs, d: tp.tp_block(s, xs, d, HEADS, sequence_parallel, algorithm)


def _pieces(a, devices, sequence_parallel):
    """The sequence shards of ``a`` (or copies of it), one per device."""
    n = len(devices)
    return collectives.place(np.split(a, n, axis=1) if sequence_parallel else [a] * n, devices)


def _step(kind, shards, devices, sequence_parallel, algorithm="direct", backward=True):
    """Forward (and the vector-Jacobian product with the cotangents ``rs``) on the devices."""
    fn = _many(kind, sequence_parallel, algorithm)

    def run(xs, rs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            outs = fn(shards, xs, devices)
        if not backward:
            return outs
        return outs, tape.gradient(outs, [xs, shards], output_gradients=rs)

    return run


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_sequence_parallel_equals_one_device(four_devices, kind, n):
    devs = four_devices[:n]
    params, x, r = _setup(kind, n)
    v = {k: tf.Variable(a) for k, a in params.items()}
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        ref = _one(kind)(v, xt)
    ref_dx, ref_dw = tape.gradient(ref, [xt, v], output_gradients=tf.constant(r))

    shards = tp.to_variables(tp.shard(params, n, HEADS), devs)
    outs, (dxs, dws) = tf.function(_step(kind, shards, devs, True))(
        _pieces(x, devs, True), _pieces(r, devs, True))
    assert all(o.shape == (B, S // n, H) for o in outs)  # each device: its own positions
    _close(np.concatenate([o.numpy() for o in outs], axis=1), ref.numpy())
    _close(np.concatenate([g.numpy() for g in dxs], axis=1), ref_dx.numpy())
    # the replicated parameters' gradients were all-reduced: every device holds the full one
    full = tp.unshard([{k: t.numpy() for k, t in g.items()} for g in dws])
    assert sorted(full) == sorted(params)
    for k in params:
        _close(full[k], ref_dw[k].numpy())


def _counted(kind, n, devices, sequence_parallel, algorithm, backward):
    params, x, r = _setup(kind, n)
    shards = tp.to_variables(tp.shard(params, n, HEADS), devices)
    sent = collectives.sent_bytes(_step(kind, shards, devices, sequence_parallel, algorithm,
                                        backward), _pieces(x, devices, sequence_parallel),
                                  _pieces(r, devices, sequence_parallel))
    assert len(sent) == n and len(set(sent.values())) == 1, sent  # every device sends as much
    return next(iter(sent.values()))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_bytes_counted_in_the_graph_match_the_formula(four_devices, kind, n):
    devs = four_devices[:n]
    act = B * S * H * 8  # one float64 activation, the whole sequence
    per = {"mlp": 1, "block": 2}[kind]  # all-reduces per pass (Megatron-LM, section 3)
    replicated = {"mlp": 1, "block": 6}[kind] * H * 8  # b2 (+ LayerNorms, bo): their gradients
    # by hand: an all-gather of seq/n shards sends (n-1) shards, a reduce-scatter (n-1)/n of
    # the activation: together 2(n-1)/n of it, what a ring all-reduce sends
    pair = (n - 1) * act // n + (n - 1) * act // n
    hand = {"forward": per * pair, "backward": per * pair + (n - 1) * replicated}
    formula = tp.bytes_per_phase(kind, [B, S, H], n, itemsize=8, sequence_parallel=True)
    assert formula == hand
    assert tp.bytes_per_step(kind, [B, S, H], n, 8, sequence_parallel=True) == sum(hand.values())
    forward = _counted(kind, n, devs, True, "direct", backward=False)
    both = _counted(kind, n, devs, True, "direct", backward=True)
    assert (forward, both - forward) == (hand["forward"], hand["backward"])
    # the tensor-parallel version with ring all-reduces sends the same activation bytes
    ring = tp.bytes_per_phase(kind, [B, S, H], n, itemsize=8, algorithm="ring")
    assert ring == {"forward": per * pair, "backward": per * pair}
    ring_forward = _counted(kind, n, devs, False, "ring", backward=False)
    assert ring_forward == forward == ring["forward"]
    # the default "direct" all-reduce sends (n - 1) whole activations (counted in the graph by
    # tests/course/test_tensor_parallel.py)
    assert tp.bytes_per_phase(kind, [B, S, H], n, itemsize=8)["forward"] == per * (n - 1) * act


@pytest.mark.parametrize("n", [2, 4])
def test_activation_bytes_between_the_regions(four_devices, n):
    devs = four_devices[:n]
    params, x, _ = _setup("block", n)
    shards = tp.to_variables(tp.shard(params, n, HEADS), devs)
    replicated = tp.region_activation_bytes(shards, _pieces(x, devs, False), devs, HEADS)
    split = tp.region_activation_bytes(shards, _pieces(x, devs, True), devs, HEADS,
                                       sequence_parallel=True)
    # by hand: seven [B, S, H] float64 tensors per device, or seven [B, S/n, H] ones
    for counted, seq in ((replicated, S), (split, S // n)):
        assert sorted(map(_where, counted)) == sorted(map(_where, devs))
        for per in counted.values():
            assert per == {name: B * seq * H * 8 for name in tp.REGION_TENSORS}
    assert all(sum(replicated[d].values()) == n * sum(split[d].values()) for d in split)


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="seq=6 is not divisible by n=4 devices"):
        tp.bytes_per_phase("block", [2, 6, 8], 4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"activation_shape must be \[batch, seq, hidden\]"):
        tp.bytes_per_phase("block", [2, 8], 4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"activation_shape must be an int >= 1, got 0"):
        tp.bytes_per_phase("block", [2, 0, 8], 4)
    with pytest.raises(ValueError, match="kind must be one of"):
        tp.bytes_per_step("attention", [2, 8, 8], 4)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        tp.bytes_per_phase("mlp", [2, 8, 8], 4, algorithm="star")
