"""Chapters 07 and 08: the exercise checks of accel.course.scaling say "not yet" to the placeholder,
"right" to the answer worked out by hand here, and "not quite" to a wrong one."""

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
