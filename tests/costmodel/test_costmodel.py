"""accel.costmodel: the arithmetic of the models, against hand calculations and literal figures."""

import pytest

from accel.costmodel import hardware, steps


def test_training_flops_by_hand():
    assert steps.training_flops(1.0, 10, 2) == pytest.approx(60e9)


def test_days_to_train():
    assert steps.days_to_train(86400e12, 1.0) == pytest.approx(1.0)
    assert steps.days_to_train(86400e12, 1.0, 0.5) == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"forward_gflops": 0}, "forward_gflops must be a number > 0, got 0"),
    ({"examples": 0}, "examples must be an int >= 1, got 0"),
    ({"epochs": 1.5}, "epochs must be an int >= 1, got 1.5")])
def test_training_flops_rejects_bad_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        steps.training_flops(**{"forward_gflops": 1.0, "examples": 1, "epochs": 1, **kwargs})


def test_days_to_train_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"utilization must be in \(0, 1\], got 1.5"):
        steps.days_to_train(1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="tflops must be a number > 0, got 0.0"):
        steps.days_to_train(1.0, 0.0)


def test_transfer_time_model():
    assert steps.transfer_time(15_750_000_000, "PCIe 3.0 x16") == pytest.approx(1.0)
    assert steps.transfer_time(0, "PCIe 4.0 x16") == 0.0
    with pytest.raises(ValueError, match="link must be one of .* got 'USB'"):
        steps.transfer_time(1, "USB")
    with pytest.raises(ValueError, match="nbytes must be a number >= 0, got -1"):
        steps.transfer_time(-1, "PCIe 3.0 x16")


def test_data_parallel_step_time_by_hand():
    # 100 MB of gradients at 10 GB/s: one copy = 10 ms
    assert steps.data_parallel_step_time(1, 0.1, 1e8, 1e10) == pytest.approx(0.1)
    assert steps.data_parallel_step_time(4, 0.1, 1e8, 1e10) == pytest.approx(0.1 + 1.5 * 0.01)
    assert steps.data_parallel_step_time(4, 0.1, 1e8, 1e10, "one_device") == pytest.approx(0.16)
    assert steps.data_parallel_step_time(4, 0.1, 1e8, 1e10, "host") == pytest.approx(0.18)
    assert steps.data_parallel_step_time(1, 0.1, 1e8, 1e10, "host") == pytest.approx(0.12)
    assert steps.data_parallel_step_time(2, 0, 0, 1, latency_s=1e-3) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="scheme must be one of .* got 'tree'"):
        steps.data_parallel_step_time(2, 0.1, 1.0, 1.0, scheme="tree")


def test_overlapped_step_time_by_hand():
    # 2 devices: a ring moves 2(n-1)/n = 1 gradient size; 100 bytes at 100 B/s = 1 s in all;
    # forward 1 s, backward 2 s making the gradients evenly
    one = steps.overlapped_step_time(2, 1.0, 2.0, 100, 100)
    assert one["step_s"] == pytest.approx(steps.data_parallel_step_time(2, 3.0, 100, 100))
    assert (one["exposed_s"], one["buckets"]) == (pytest.approx(1.0), 1)
    # two buckets: ready at 2 s and 3 s, half a second each: the first hidden, the second not
    two = steps.overlapped_step_time(2, 1.0, 2.0, 100, 100, bucket_bytes=50)
    assert (two["step_s"], two["exposed_s"], two["comm_s"]) == (
        pytest.approx(3.5), pytest.approx(0.5), pytest.approx(1.0))
    # four buckets with 0.1 s latency (2 ring steps each): 0.45 s per bucket, ready every 0.5 s
    four = steps.overlapped_step_time(2, 1.0, 2.0, 100, 100, bucket_bytes=25, latency_s=0.1)
    assert (four["step_s"], four["comm_s"], four["buckets"]) == (
        pytest.approx(3.45), pytest.approx(1.8), 4)
    # a fixed cost per all-reduce on top: 0.2 s more per bucket
    based = steps.overlapped_step_time(2, 1.0, 2.0, 100, 100, bucket_bytes=50, base_latency_s=0.2)
    assert (based["step_s"], based["comm_s"]) == (pytest.approx(3.7), pytest.approx(1.4))
    # a last bucket of what remains; the link busy longer than the backward queues the buckets
    odd = steps.overlapped_step_time(2, 0.0, 1.0, 100, 10, bucket_bytes=60)
    assert (odd["buckets"], odd["step_s"]) == (2, pytest.approx(0.6 + 6 + 4))
    with pytest.raises(ValueError, match="bucket_bytes must be a number > 0"):
        steps.overlapped_step_time(2, 1.0, 1.0, 100, 100, bucket_bytes=0)


def test_roofline_by_hand():
    # 1024 x 1024 in float32: 2 * 1024**3 FLOPs over 3 * 1024**2 * 4 bytes = 1024 / 6
    assert steps.matmul_intensity(1024) == pytest.approx(1024 / 6)
    assert steps.matmul_intensity(30, 2) == pytest.approx(10.0)
    # 100 FLOP/s peak, 10 B/s: memory-bound below 10 FLOP/byte, compute-bound above
    assert steps.roofline(2.0, 100.0, 10.0) == pytest.approx(20.0)
    assert steps.roofline(50.0, 100.0, 10.0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="intensity must be a number > 0"):
        steps.roofline(0, 1.0, 1.0)


def test_hardware_figures_against_the_data_sheets():
    assert hardware.peak_flops("NVIDIA A100", "fp32") == 19.5e12
    assert hardware.peak_flops("NVIDIA A100", "bf16") == 312e12
    assert hardware.peak_flops("NVIDIA V100", "fp16") == 125e12
    assert hardware.link_bandwidth("NVLink 3 (A100, per GPU)") == 300e9
    assert hardware.link_bandwidth("PCIe 4.0 x16") == 31.5e9
    assert all(spec.source for peaks in hardware.PEAK_TFLOPS.values() for spec in peaks.values())
    assert all(spec.source for spec in hardware.LINKS.values())
    with pytest.raises(ValueError, match=r"NVIDIA V100 has no 'tf32' peak .* \['fp16', 'fp32'\]"):
        hardware.peak_flops("NVIDIA V100", "tf32")
