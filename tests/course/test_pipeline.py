"""Chapter 10's experiments (accel.course.pipeline): the exercises' checks, the stage builders'
errors."""

import pytest

from accel.course.pipeline import check_exercise, square_stages
from accel.parallel import pipeline as pl


def test_chapter_10_exercise_solutions():
    assert check_exercise(1, None) == "exercise 1: not answered yet"
    assert check_exercise(1, 7 / 39) == "exercise 1: correct"
    assert check_exercise(1, 7 / 32) == "exercise 1: not quite, try again"
    assert check_exercise(2, pl.one_f_one_b_schedule(3, 2)) == "exercise 2: correct"
    assert check_exercise(2, pl.gpipe_schedule(3, 2)) == "exercise 2: not quite, try again"
    assert check_exercise(3, 63) == "exercise 3: correct"   # 63 / 70 = 0.9
    assert check_exercise(3, 62) == "exercise 3: not quite, try again"


def test_square_stages_need_a_device_each(four_devices):
    with pytest.raises(ValueError, match="2 stages need 2 devices, got 1"):
        square_stages(four_devices[:1], [1, 1])
