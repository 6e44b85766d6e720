"""accel.parallel.context against attention on one device (a plain softmax(q k^T / sqrt(d)) v
written here, causal mask from tf.linalg.band_part): outputs reassembled from the sequence
shards and the gradients of q, k and v, for the ring, all-gather and Ulysses methods, causal
and not, on 2 and 4 devices; the bytes each device sends, counted in the graph that ran,
against the formulas (and a hand count)."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.parallel import context as cp

B, S, HEADS, D = 2, 8, 4, 4
RUN = {"ring": cp.ring_attention, "all_gather": cp.all_gather_attention,
       "ulysses": cp.ulysses_attention}


def _close(actual, ref):
    ref = np.asarray(ref)
    np.testing.assert_allclose(actual, ref, rtol=1e-5, atol=1e-6 * np.max(np.abs(ref)))


def _reference(q, k, v, causal):
    """[batch, seq, heads, d] -> the same, heads handled by a transpose."""
    qt, kt, vt = (tf.transpose(t, [0, 2, 1, 3]) for t in (q, k, v))
    s = tf.matmul(qt, kt, transpose_b=True) / np.sqrt(D)
    if causal:
        lower = tf.linalg.band_part(tf.ones_like(s), -1, 0)
        s = s * lower - 1e30 * (1 - lower)
    return tf.transpose(tf.matmul(tf.nn.softmax(s), vt), [0, 2, 1, 3])


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, S, HEADS, D)) for _ in range(4)]  # q, k, v, cotangent


def _with_grads(fn, q, k, v, r):
    q, k, v = (tf.constant(t) for t in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = fn(q, k, v)
    return [out.numpy()] + [g.numpy() for g in tape.gradient(out, [q, k, v],
                                                             output_gradients=tf.constant(r))]


def _split(a, devices):
    return collectives.place(np.split(a, len(devices), axis=1), devices)


def _parallel(method, devices, causal, backward=True):
    def run(qs, ks, vs, rs):
        with tf.GradientTape() as tape:
            tape.watch([qs, ks, vs])
            outs = RUN[method](qs, ks, vs, devices, causal)
        if not backward:
            return outs
        return outs, tape.gradient(outs, [qs, ks, vs], output_gradients=rs)
    return run


@pytest.mark.parametrize("causal", [False, True])
def test_one_device_attention_equals_the_reference(causal):
    q, k, v, r = _data(3)
    for got, ref in zip(_with_grads(lambda q, k, v: cp.attention(q, k, v, causal), q, k, v, r),
                        _with_grads(lambda q, k, v: _reference(q, k, v, causal), q, k, v, r),
                        strict=True):
        _close(got, ref)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", list(cp.METHODS))
def test_context_parallel_equals_one_device(four_devices, method, n, causal):
    devs = four_devices[:n]
    q, k, v, r = _data()
    ref = _with_grads(lambda q, k, v: _reference(q, k, v, causal), q, k, v, r)
    run = _parallel(method, devs, causal)
    if n == 4 and causal:  # also traced: the gradients' placement differs in a graph
        run = tf.function(run)
    outs, grads = run(*(_split(t, devs) for t in (q, k, v, r)))
    assert all(o.shape == (B, S // n, HEADS, D) for o in outs)
    for got, want in zip([outs, *grads], ref, strict=True):
        _close(np.concatenate([t.numpy() for t in got], axis=1), want)


@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_skips_blocks_above_the_diagonal(four_devices, causal):
    """Two einsums per block (scores, then the weighted values), counted per device in the
    traced graph: device i attends to blocks 0..i when causal (i + 1 of them), else to all n."""
    n = 4
    args = [_split(t, four_devices) for t in _data()[:3]]
    graph = tf.function(lambda qs, ks, vs: cp.ring_attention(
        qs, ks, vs, four_devices, causal)).get_concrete_function(*args).graph
    einsums = [tf.DeviceSpec.from_string(op.device).device_index
               for op in graph.get_operations() if op.type == "Einsum"]
    assert sorted(einsums) == sorted(i for i in range(n)
                                     for _ in range(2 * (i + 1 if causal else n)))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", list(cp.METHODS))
def test_bytes_counted_in_the_graph_match_the_formula(four_devices, method, n):
    devs = four_devices[:n]
    block = B * (S // n) * HEADS * D * 8  # one float64 shard of q, k or v
    hand = {"ring": 2 * (n - 1) * block,  # a K and a V block, n - 1 passes
            "all_gather": 2 * (n - 1) * block,  # K and V: (n - 1) shards each
            "ulysses": 4 * (n - 1) * block // n}[method]  # q, k, v, out: (n - 1) / n each
    formula = cp.context_bytes(method, [B, S // n, HEADS, D], n, itemsize=8)
    assert formula == {"forward": hand, "backward": hand}
    args = [_split(t, devs) for t in _data()]
    counted = {}
    for backward in (False, True):
        sent = collectives.sent_bytes(_parallel(method, devs, True, backward), *args)
        assert len(sent) == n and len(set(sent.values())) == 1, sent
        counted[backward] = next(iter(sent.values()))
    assert counted[False] == formula["forward"]
    assert counted[True] - counted[False] == formula["backward"]


def test_bad_input_names_the_value(four_devices):
    devs = four_devices[:2]
    x = _split(np.ones((B, S, 3, D)), devs)
    with pytest.raises(ValueError, match="heads=3 is not divisible by n=2 devices"):
        cp.ulysses_attention(x, x, x, devs)
    with pytest.raises(ValueError, match="heads=3 is not divisible by n=2 devices"):
        cp.context_bytes("ulysses", [B, S // 2, 3, D], 2)
    y = _split(np.ones((B, S, 4, D)), devs)
    with pytest.raises(ValueError, match="q, k and v shards differ in shape"):
        cp.ring_attention(x, y, y, devs)
    with pytest.raises(ValueError, match=r"got 1 tensors for 2 devices"):
        cp.all_gather_attention(x[:1], x[:1], x[:1], devs)
    with pytest.raises(ValueError, match="method must be one of"):
        cp.context_bytes("tree", [B, S, HEADS, D], 2)
    with pytest.raises(ValueError, match=r"shard_shape must be \[batch, seq / n, heads"):
        cp.context_bytes("ring", [B, S, HEADS], 2)
