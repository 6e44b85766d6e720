"""accel.course.strategies: the chapter's table of strategies, its input table, the exercise."""

from accel.course import strategies as course


def test_strategy_table_covers_every_strategy_and_column():
    assert list(course.STRATEGIES) == [
        "default", "OneDeviceStrategy", "MirroredStrategy", "CentralStorageStrategy",
        "MultiWorkerMirroredStrategy", "ParameterServerStrategy"]
    lines = course.table_lines()
    assert lines[0].split() == ["strategy", "variables", "gradients"]
    assert course.table_lines(columns=("updates", "use"))[0].split() == [
        "strategy", "updates", "use"]
    assert len(lines) == 7
    assert course.compact(["f0:0", "f0:1", "f0:2", "f2:0", "f3:1", "f3:3"]) == "f0:0-2 f2:0 f3:1,3"


def test_input_table_one_line_per_key():
    reports = [{"input": {"FILE": ["f0:0", "f0:1"]}}, {"input": {"FILE": ["f1:0", "f1:1"]}}]
    assert course.input_table(reports, ("FILE",)) == ["FILE  worker 0: f0:0-1 | worker 1: f1:0-1"]


def test_exercise_solution_and_placeholder():
    assert course.check_resume(None).startswith("not yet")
    assert course.check_resume((6, 1)) == "right"
    assert course.check_resume((7, 0)).startswith("not (7, 0)")
