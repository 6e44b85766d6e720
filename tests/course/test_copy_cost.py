"""accel.course.copy_cost: the hopping chain equals the one-device chain (forward and gradient);
the measurement's shape (never its timings)."""

import numpy as np
import pytest
import tensorflow as tf

from accel import placement
from accel.course import copy_cost


def test_hopping_chain_matches_one_device_forward_and_gradient(four_devices):
    x = tf.constant(np.linspace(-1.0, 1.0, 16, dtype=np.float32))
    results = {}
    for label, devs in (("one", four_devices[:1]), ("hop", four_devices)):
        fn = copy_cost.chain_function(devs, 12)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        results[label] = (y.numpy(), tape.gradient(y, x).numpy())
    np.testing.assert_allclose(results["hop"][0], results["one"][0], rtol=1e-6)
    np.testing.assert_allclose(results["hop"][1], results["one"][1], rtol=1e-6)


def test_chain_crosses_devices_at_every_step(four_devices):
    small = tf.ones((8,))
    one = placement.placement_of(copy_cost.chain_function(four_devices[:1], 10), small)
    hop = placement.placement_of(copy_cost.chain_function(four_devices[:2], 10), small)
    assert one.transfers == []
    assert len(hop.transfers) == 9
    assert {src for _, src, _ in hop.transfers} == set(four_devices[:2])


def test_consume_function_runs_on_the_requested_device(four_devices):
    table = placement.placement_of(copy_cost.consume_function(four_devices[1]), tf.ones((4,)))
    assert table.device_of("Sum") == four_devices[1]
    assert float(table.result) == 8.0


def test_measure_copy_cost_reports_times_and_ratios(four_devices):
    result = copy_cost.measure_copy_cost(four_devices[:2], size=1024, chain=4, repeat=1)
    times = ("chain on one device", "chain hopping", "tensor used in place",
             "tensor used elsewhere")
    assert set(result) == {*times, "chain_ratio", "bulk_ratio", "us_per_op", "us_per_hop"}
    assert all(result[k] > 0 for k in (*times, "chain_ratio", "bulk_ratio", "us_per_op"))
    # by hand: 4 steps on one device; 3 crossings in the hopping chain of 4 steps
    one, hop = result["chain on one device"], result["chain hopping"]
    assert result["us_per_op"] == pytest.approx(one / 4 * 1e6)
    assert result["us_per_hop"] == pytest.approx((hop - one) / 3 * 1e6)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"at least one device, got length=3, devices=\[\]"):
        copy_cost.chain_function([], 3)
    with pytest.raises(ValueError, match="length >= 1"):
        copy_cost.chain_function(["/cpu:0"], 0)
    with pytest.raises(ValueError, match="two devices"):
        copy_cost.measure_copy_cost(["/cpu:0"])


def test_measure_hop_cost_reports_the_chain_half_by_hand_count(four_devices):
    result = copy_cost.measure_hop_cost(four_devices[:2], chain=5, repeat=1)
    assert set(result) == {"chain on one device", "chain hopping", "chain_ratio", "us_per_op",
                           "us_per_hop"}
    one, hop = result["chain on one device"], result["chain hopping"]
    assert one > 0 and hop > 0
    # by hand: 5 steps on one device; 4 crossings in the hopping chain of 5 steps
    assert result["us_per_op"] == pytest.approx(one / 5 * 1e6)
    assert result["us_per_hop"] == pytest.approx((hop - one) / 4 * 1e6)
    assert result["chain_ratio"] == pytest.approx(hop / one)


def test_measure_hop_cost_bad_arguments():
    with pytest.raises(ValueError, match="two devices"):
        copy_cost.measure_hop_cost(["/cpu:0"])
    with pytest.raises(ValueError, match=r"chain must be >= 2 \(one crossing at least\), got 1"):
        copy_cost.measure_hop_cost(["/cpu:0", "/cpu:1"], chain=1)


def test_copy_time_is_latency_plus_bytes_by_hand():
    # 4 MiB at 50 GB/s: 83.886 us of bytes after 5 us of latency
    assert copy_cost.copy_time(4 * 2**20, 50e9, 5e-6) == pytest.approx(5e-6 + 4 * 2**20 / 50e9)
    assert copy_cost.copy_time(0, 50e9, 5e-6) == 5e-6
    # at the break-even size the bytes take exactly the latency: the copy costs twice it
    even = copy_cost.break_even_bytes(5e-6, 50e9)
    assert even == pytest.approx(250_000)
    assert copy_cost.copy_time(even, 50e9, 5e-6) == pytest.approx(2 * 5e-6)
    # the same bytes in 1024 copies pay the latency 1024 times
    many = 1024 * copy_cost.copy_time(4 * 2**10, 50e9, 5e-6)
    assert many == pytest.approx(1024 * 5e-6 + 4 * 2**20 / 50e9)
    assert copy_cost.GPU_COPY_LATENCY_S == (5e-6, 7e-6)
    assert "arXiv:2602.21548" in copy_cost.GPU_COPY_LATENCY_SOURCE


def test_copy_time_bad_arguments():
    with pytest.raises(ValueError, match="bytes_per_s must be > 0, got 0"):
        copy_cost.copy_time(1, 0, 5e-6)
    with pytest.raises(ValueError, match=r"must be >= 0, got nbytes=-1"):
        copy_cost.copy_time(-1, 1e9, 5e-6)
    with pytest.raises(ValueError, match="must be > 0"):
        copy_cost.break_even_bytes(0, 1e9)
