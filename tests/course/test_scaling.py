"""Chapters 07 and 08: the exercise checks of accel.course.scaling say "not yet" to the placeholder,
"right" to the answer worked out by hand here, and "not quite" to a wrong one."""

import pytest

from accel.course import scaling


def test_update_scale():
    assert scaling.check_update_scale(None).startswith("not yet")
    assert scaling.check_update_scale(0.15).startswith("right")  # 0.05 x 96 / 32
    assert scaling.check_update_scale(0.05).startswith("not quite")


def test_compute_for_80():
    # ring, 8 GPUs, 102.4 MB at 10 GB/s: 2 x 7/8 x 102.4e6 / 10e9 = 17.92 ms of exchange;
    # 80% efficiency means compute = 4 x exchange = 71.7 ms
    assert scaling.check_compute_for_80(None).startswith("not yet")
    assert scaling.check_compute_for_80(72).startswith("right")
    assert scaling.check_compute_for_80(50).startswith("not quite")


def test_parallel_calls():
    assert scaling.check_parallel_calls(None).startswith("not yet")
    assert scaling.check_parallel_calls(3).startswith("right")  # 80 / 3 = 26.7 <= 30 < 80 / 2
    assert scaling.check_parallel_calls(2).startswith("not quite")
    assert scaling.check_parallel_calls(2.5).startswith("not quite")


def test_final_loss_refuses_a_batch_larger_than_the_data():
    with pytest.raises(ValueError, match=r"batch_size 2048 is larger than the data set \(n=1024\)"):
        scaling.final_loss(2048, 0.1)


def test_figure_scaling_from_results():
    import matplotlib.pyplot as plt

    res = {"counts": [1, 2, 4], "per_device_batch": 8,
           "step_s": {"towers": [1.0, 2.0, 4.0], "mirrored": [1.0, 2.1, 4.2],
                      "single": [1.0, 2.0, 4.0]},
           "examples_per_s": {"towers": [8, 8, 8], "mirrored": [8, 7.6, 7.6],
                              "single": [8, 8, 8]}}
    fig = scaling.figure_scaling(res)
    assert len(fig.axes) == 2
    plt.close(fig)
    lines = scaling.format_scaling(res).splitlines()
    assert lines[0].split() == ["devices", "1", "2", "4"]
    assert lines[2].split() == ["towers", "1000.0ms", "2000.0ms", "4000.0ms"]
    assert lines[-1].endswith("1.00  0.95  0.95")


def test_timed_steps_agree_on_loss(four_devices):
    """The second call's loss depends on the first update: the three steps train alike."""
    steps = scaling.timed_steps(2, four_devices, per_device_batch=8, sizes=(4, 8, 2))
    first = {k: float(fn()) for k, fn in steps.items()}
    losses = {k: float(fn()) for k, fn in steps.items()}
    assert losses["single"] < first["single"]
    assert losses["towers"] == pytest.approx(losses["single"], rel=1e-5)
    assert losses["mirrored"] == pytest.approx(losses["single"], rel=1e-5)
