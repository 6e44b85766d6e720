"""Chapter 15's experiments: the exercises' checks with the right answers, the tables the chapter
prints (counted equals formula), the figure. (The quick benchmark runs in the test of all
benchmarks.)"""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.costmodel import zero as cost
from accel.course import zero as course


def test_exercise_checks():
    # 1: N = 8, 4 micro-batches: stage 2 (4 + 1) / (1 + 1) = 2.5; stage 3 4 x 3 / 3 = 4
    assert course.check_accumulation_ratios(None).startswith("not yet")
    assert course.check_accumulation_ratios((2.5, 4)).startswith("right")
    assert course.check_accumulation_ratios((1, 1)).startswith("not quite")
    assert course.check_accumulation_ratios("two").startswith("not quite")
    # 2: per GPU and billion parameters, compute 6e9 x 1024 / 156e12 = 39 ms, link 2e9 / 8 /
    # 31.5e9 = 8 ms, host Adam 28e9 / 8 / 51.2e9 = 68 ms: the host's Adam
    assert course.check_offload_bound(None).startswith("not yet")
    assert course.check_offload_bound("host adam").startswith("right")
    assert course.check_offload_bound("compute").startswith("not quite")
    # 3: 1/60 against 1/180 per token
    assert course.check_token_weight(None).startswith("not yet")
    assert course.check_token_weight(3).startswith("right")
    assert course.check_token_weight(1).startswith("not quite")

    assert course.check_prefetch_layers(None).startswith("not yet")
    assert course.check_prefetch_layers(3).startswith("right")
    assert course.check_prefetch_layers(2).startswith("not quite")
    assert course.check_prefetch_layers("three").startswith("not quite")

    # 13e9 params, 8 GPUs: stage 2 = 2 x 13 + 14 x 13 / 8 = 48.75 GB > 40; stage 3 = 26 GB,
    # sending 3 (n-1)/n against stage 1's 2 (n-1)/n of the same 16-bit bytes: 1.5
    assert course.check_stage_for_budget(None).startswith("not yet")
    assert course.check_stage_for_budget((3, 1.5)).startswith("right")
    assert course.check_stage_for_budget((2, 1.0)).startswith("not quite")
    assert course.check_stage_for_budget("x").startswith("not quite")


@pytest.mark.slow  # several seconds: left to make test, out of make quick
def test_tables_count_what_the_formulas_say(four_devices):
    steps = course.make_steps(four_devices, n=4, sizes=[4, 8, 4], batch=8)
    assert "offload" not in steps  # no device left for the host
    for _, held, formula, _ in course.held_table(steps):
        assert held["total"] == formula
    for _, low, high, formula in course.sent_table(steps):
        assert low == high == formula


def test_figure():
    import matplotlib.pyplot as plt

    fig = course.figure_zero_memory()
    assert len(fig.axes[0].patches) == 12  # 4 stages x 3 parts
    plt.close(fig)


def test_host_adam_in_the_offload_model():
    """28 bytes per parameter at the host's bandwidth, over the process's partition: A100 at
    50% of 312e12 bf16 FLOP/s; one GPU with a 204.8 GB/s socket: 28 * 156e12 / (6 * 204.8e9)
    tokens; 8 GPUs each with 51.2 GB/s and an eighth of the parameters: 28 * 156e12 /
    (6 * 8 * 51.2e9), the same as one GPU with all 409.6 GB/s."""
    assert course.HOST_ADAM_BYTES_PER_PARAM == 28
    tokens = course.host_adam_break_even_tokens("NVIDIA A100", 204.8e9)
    assert tokens == pytest.approx(28 * 156e12 / (6 * 204.8e9))
    eight = course.host_adam_break_even_tokens("NVIDIA A100", 51.2e9, n=8)
    assert eight == pytest.approx(28 * 156e12 / (6 * 8 * 51.2e9))
    assert eight == pytest.approx(course.host_adam_break_even_tokens("NVIDIA A100", 409.6e9))
    e = course.offload_with_host_adam(10**9, 4096, "NVIDIA A100", "PCIe 4.0 x16", 51.2e9, n=8)
    assert e["adam_s"] == pytest.approx(28e9 / 8 / 51.2e9)
    assert e["transfer_s"] == pytest.approx(2e9 / 8 / 31.5e9)
    assert e["serial_s"] == pytest.approx(max(e["compute_s"], e["transfer_s"]) + e["adam_s"])
    assert e["dpu_s"] == pytest.approx(max(e["compute_s"], e["transfer_s"], e["adam_s"]))
    big = course.offload_with_host_adam(10**9, 10**5, "NVIDIA A100", "PCIe 4.0 x16", 51.2e9)
    assert big["dpu_s"] == big["compute_s"] < big["serial_s"]
    assert set(course.OFFLOAD_SETUPS.values()) == {(1, 204.8e9), (8, 51.2e9)}


def test_gathered_bytes_by_hand(four_devices):
    """Stage 3 of the MLP 4-8-4 on 4 devices: layer 0 is 4 x 8 + 8 = 40 floats (160 bytes),
    layer 1 8 x 4 + 4 = 36 (144 bytes), gathered whole on device 0."""
    steps = course.make_steps(four_devices, n=4, sizes=[4, 8, 4], batch=8)
    step, xs, ys = steps["zero3"]
    assert course.gathered_bytes(step, xs, ys) == {0: 160, 1: 144}
    with pytest.raises(ValueError, match="stage 3"):
        course.gathered_bytes(steps["zero2"][0], xs, ys)


def test_gather_waits_by_hand(four_devices):
    """Three layers, prefetch 1: forward, layer 2's gather waits for layer 0; backward (layer
    2 first), layers 2 and 1 wait for the forward's end (layer 2's output), layer 0 for layer
    2's backward. Without prefetch: nothing waits."""
    from accel.models import mlp_init
    from accel.parallel.zero import ZeroStep
    from accel.training import squared_error

    params = mlp_init([4, 8, 8, 4], seed=0)
    xs = collectives.place([tf.ones((2, 4))] * 4, four_devices)
    ys = collectives.place([tf.ones((2, 4))] * 4, four_devices)
    waits = {}
    for p in (None, 1):
        step = ZeroStep(params, four_devices, 3, squared_error,
                        layer_fns=course.mlp_layer_fns(params), prefetch=p)
        waits[p] = course.gather_waits(step, xs, ys)
    assert waits[None] == {}
    assert list(waits[1].items()) == [
        ("fwd_gather_2", ["fwd_layer_0"]), ("bwd_gather_2", ["fwd_layer_2"]),
        ("bwd_gather_1", ["fwd_layer_2"]), ("bwd_gather_0", ["bwd_layer_2"])]


@pytest.mark.slow  # a profiler trace (seconds)
def test_stage3_timeline_has_every_gather_and_layer(four_devices, tmp_path):
    from accel.models import mlp_init
    from accel.parallel.zero import ZeroStep
    from accel.training import squared_error

    params = mlp_init([8, 16, 16, 8], seed=0)
    step = ZeroStep(params, four_devices, 3, squared_error,
                    layer_fns=course.mlp_layer_fns(params), prefetch=0)
    xs = collectives.place([tf.ones((2, 8))] * 4, four_devices)
    ys = collectives.place([tf.ones((2, 8))] * 4, four_devices)
    seen = course.stage3_timeline(step, xs, ys, str(tmp_path))
    gathers = {label for lane, _, _, label in seen["intervals"] if lane == "all-gather"}
    assert gathers == {"f0", "f1", "f2", "b0", "b1", "b2"}
    assert seen["early"] == 0 and seen["gathers"] == 2  # prefetch 0: never before


def test_keras_sent_bytes_by_hand(four_devices):
    """Dense 4 -> 8 -> 2 in float32 (58 parameters, every variable even: no padding), N = 2,
    2 micro-batches per device; half of the weights is 116 bytes. Stage 1: one reduce-scatter
    and one all-gather, 232; stage 2: a reduce-scatter per micro-batch, 2 x 116 + 116 = 348;
    offload: 348 + each micro-batch's slice to the host (2 x 116) = 580 per device, and the
    host sends each device its slice, 2 x 116 = 232."""
    import keras

    from accel.parallel.offload import Offload
    from accel.parallel.zero import Zero

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                 keras.layers.Dense(2)])

    x = np.ones((8, 4), np.float32)
    y = np.ones((8, 2), np.float32)
    two = four_devices[:2]
    for stage, want in ((1, 232), (2, 348)):
        zero = Zero(model(), two, loss="mse", optimizer="adam", stage=stage,
                    accumulation_steps=2)
        assert course.keras_sent_bytes(zero, x, y) == {d: want for d in two}
        assert want == cost.zero_comm_bytes_accumulated(58, 2, stage, 2, "fp32")
    offload = Offload(model(), two, host=four_devices[3], loss="mse", optimizer="adam",
                      accumulation_steps=2)
    assert course.keras_sent_bytes(offload, x, y) == {two[0]: 580, two[1]: 580,
                                                       four_devices[3]: 232}


def test_variables_on_places_one_part_per_device(four_devices):
    parts = np.split(np.arange(32.0).reshape(16, 2), 4)  # 4 rows each
    shards = course.variables_on(parts, four_devices)
    for v, part, device in zip(shards, parts, four_devices, strict=True):
        assert isinstance(v, tf.Variable)
        assert v.device.endswith(device.split("device:")[-1])  # e.g. CPU:2, not CPU:0
        np.testing.assert_array_equal(v.numpy(), part)
    with pytest.raises(ValueError, match="3 values for 4 devices"):
        course.variables_on(parts[:3], four_devices)
