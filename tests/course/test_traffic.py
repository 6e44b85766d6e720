"""Chapter 13's precision and pack-order helpers (``accel.course.traffic``) against independent
computations: NumPy with ml_dtypes' bfloat16 for the sums, TensorFlow's packing rule worked by
hand for the packs, one device's gradient for the all-reduced sums."""


import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from accel.course import collectives as course
from accel.course import overlap, traffic


def _numpy_errors(ns, count, seed):
    grads = np.random.default_rng(seed).standard_normal((max(ns), count)).astype(np.float32)
    out = {name: [] for name in traffic.SUMMATIONS}
    for n in ns:
        exact = grads[:n].astype(np.float64).sum(axis=0)
        for name, wire, keep in (("float32", np.float32, np.float32),
                                 ("bfloat16 sent, float32 sums", ml_dtypes.bfloat16, np.float32),
                                 ("bfloat16 sums", ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                 ("float16 sums", np.float16, np.float16)):
            acc = grads[0].astype(wire).astype(keep)
            for i in range(1, n):  # one rounding per addition, to the type the sum is kept in
                acc = (acc.astype(np.float32) + grads[i].astype(wire).astype(np.float32)
                       ).astype(keep)
            err = acc.astype(np.float64) - exact
            out[name].append(np.sqrt(np.mean(err ** 2) / np.mean(exact ** 2)))
    return out


def test_summation_errors_equal_numpy_with_ml_dtypes():
    ns = (2, 5, 9)
    got = traffic.summation_errors(ns, count=257, seed=3)
    want = _numpy_errors(ns, 257, 3)
    for name in traffic.SUMMATIONS:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
    # rounding only what is sent keeps one rounding's error; rounding every partial sum grows
    assert got["bfloat16 sums"][-1] > got["bfloat16 sent, float32 sums"][-1]
    with pytest.raises(ValueError, match="ns is empty"):
        traffic.summation_errors(())
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        traffic.summation_errors((0,))


@pytest.fixture(scope="module")
def small(four_devices):
    """A 3-layer MLP of width 8 (kernels of 256 bytes, biases of 32; out: 32 and 4) and the
    course's collective strategy over the four devices."""
    model = overlap.deep_mlp(four_devices, depth=3, width=8)
    x, y = overlap.deep_batch(model, batch=8)
    return model, x, y, course.tf_strategy(tuple(four_devices), "collective")


def test_pack_order_follows_tensorflows_rule_and_the_token_chain(small, four_devices):
    model, x, y, strategy = small
    # TF reverses the list, then closes a pack once it holds more than 256 bytes:
    # out/b 4 + out/k 32 + d2/b 32 + d2/k 256 | d1/b + d1/k | d0/b + d0/k
    step = traffic.pack_step(strategy, model, x, y, 256)
    packs = traffic.pack_order(step, model, four_devices[0])
    assert [p.holds for p in packs] == [("d2", "out"), ("d1",), ("d0",)]
    assert [p.needs for p in packs] == [p.holds for p in packs]
    assert packs[0].after is None and [p.after for p in packs[1:]] == [p.op for p in packs[:-1]]
    assert [p.waits for p in packs] == [("d2", "out"), ("d1", "d2", "out"),
                                        ("d0", "d1", "d2", "out")]
    # handed over last layer first, TF's reversal puts d0 first: every pack waits for it
    flipped = traffic.pack_order(traffic.pack_step(strategy, model, x, y, 256, reverse=True),
                                 model, four_devices[0])
    assert [p.holds for p in flipped] == [("d0",), ("d1",), ("d2",), ("out",)]
    assert all("d0" in p.waits for p in flipped)
    with pytest.raises(ValueError, match="no CollectiveReduceV2"):
        traffic.pack_order(step, model, "/device:GPU:7")
    with pytest.raises(ValueError, match="bytes_per_pack"):
        traffic.pack_step(strategy, model, x, y, -1)


def test_traced_packs_sum_like_one_device_and_start_in_order(small, four_devices):
    model, x, y, strategy = small
    step = traffic.pack_step(strategy, model, x, y, 256)
    packs = traffic.pack_order(step, model, four_devices[0])
    with tf.GradientTape() as tape:  # every replica runs the same batch: the sum is 4 times it
        loss = tf.reduce_mean((model(x) - y) ** 2)
    one = tape.gradient(loss, model.trainable_variables)
    summed = strategy.experimental_local_results(step())[0]
    for got, ref in zip(summed, one, strict=True):
        np.testing.assert_allclose(got.numpy(), 4 * ref.numpy(), rtol=1e-5,
                                   atol=1e-6 * np.abs(4 * ref.numpy()).max())
    seen = traffic.traced_packs(step, packs, four_devices[0])
    assert seen["in_order"]
    assert len(seen["runs"]) == len(packs)
    assert all(ready <= start <= end for ready, start, end in seen["runs"])
    assert {lane for lane, *_ in seen["intervals"]} == {"input gradients", "weight gradients",
                                                        "pack data", "collectives"}


def test_layer_pack_step_sums_every_layer_and_gates_the_backward(small, four_devices):
    """One pack per layer, last layer first, each the sum of four replicas' gradients (every
    replica runs the same batch: 4 times one device's); every layer's input gradient but the
    first layer's waits for that layer's pack, and the collectives are chained in that order."""
    model, x, y, strategy = small
    step = traffic.layer_pack_step(strategy, model, x, y)
    packs = traffic.pack_order(step, model, four_devices[0])
    names = [layer.name for layer in model.layers][::-1]
    assert [p.holds for p in packs] == [(n,) for n in names]
    assert [p.gates for p in packs] == [(n,) for n in names[:-1]] + [()]
    assert packs[0].after is None and [p.after for p in packs[1:]] == [p.op for p in packs[:-1]]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    one = tape.gradient(loss, model.trainable_variables)
    per_layer = [np.concatenate([g.numpy().ravel() for g in one[2 * k:2 * k + 2]])
                 for k in range(len(model.layers))][::-1]
    summed = strategy.experimental_local_results(step())[0]
    for got, ref in zip(summed, per_layer, strict=True):
        np.testing.assert_allclose(got.numpy(), 4 * ref, rtol=1e-5,
                                   atol=1e-6 * np.abs(4 * ref).max())
    # TensorFlow's own packing gates nothing
    own = traffic.pack_step(strategy, model, x, y, 256)
    assert all(p.gates == () for p in traffic.pack_order(own, model, four_devices[0]))
    seen = traffic.traced_packs(step, packs, four_devices[0])
    # the control edges guarantee it: every pack but the first layer's exists before the end
    assert seen["made_before_end"] >= len(packs) - 1
    assert seen["made_order"] == list(range(len(packs)))
    assert 0 <= seen["started_before_end"] <= len(packs)


def test_interleaved_spread_times_every_function_in_each_round():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    out = traffic.interleaved_spread(fns, rounds=2, repeat=3, warmup=1)
    assert calls == ["a", "b"] + (["a"] * 3 + ["b"] * 3) * 2  # warm-up, then rounds in turn
    for median, low, high in out.values():
        assert 0 <= low <= median <= high
    with pytest.raises(ValueError, match="rounds"):
        traffic.interleaved_spread(fns, rounds=0)


def test_packing_times_with_spread_counts_the_buckets(four_devices):
    out = traffic.packing_times(four_devices, tensors=4, size=8, pack_bytes=(0, 1 << 30),
                                repeat=1, rounds=2, with_spread=True)
    assert {p: calls for p, (_, calls, _) in out.items()} == {0: 4, 1 << 30: 1}
    assert all(low <= t <= high for t, _, (low, high) in out.values())
    plain = traffic.packing_times(four_devices, tensors=4, size=8, pack_bytes=(0,), repeat=1)
    assert len(plain[0]) == 2  # (seconds, all-reduces), as the benchmark reads it
