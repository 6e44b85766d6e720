"""accel.scale: the scale-of-the-problem arithmetic."""

import pytest

from accel import scale


def test_training_flops_defaults_are_inception_on_imagenet():
    assert scale.training_flops() == pytest.approx(3 * 5.7e9 * 1_281_167 * 100)
    assert scale.training_flops(1.0, 10, 2) == pytest.approx(60e9)


def test_days_to_train():
    assert scale.days_to_train(86400e12, 1.0) == pytest.approx(1.0)
    assert scale.days_to_train(86400e12, 1.0, 0.5) == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs", [{"forward_gflops": 0}, {"examples": 0}, {"epochs": 0}])
def test_training_flops_rejects_bad_inputs(kwargs):
    with pytest.raises(ValueError, match="positive"):
        scale.training_flops(**kwargs)


def test_days_to_train_rejects_bad_inputs():
    with pytest.raises(ValueError, match="utilization"):
        scale.days_to_train(1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="tflops > 0"):
        scale.days_to_train(1.0, 0.0)


def test_measure_matmul_tflops_is_positive():
    assert scale.measure_matmul_tflops(n=64, repeat=1) > 0
