"""The exercises of chapters 01-03: each check says "not answered yet" for the placeholder the
stored notebook holds, "correct" for the solution written here, and not correct for a wrong one."""

import tensorflow as tf

from accel import placement
from accel.course import basics, training_cost


def test_placeholders_are_not_answered_yet(four_devices):
    assert basics.check_full_name(None) == "exercise 1: not answered yet"
    assert basics.check_merge(None) == "exercise 2: not answered yet"
    assert training_cost.check_hours_exercise(None) == "exercise 3: not answered yet"
    assert basics.check_mul_router(None) == "exercise 2: not answered yet"
    assert basics.check_add_on_cpu1(None) == "exercise 3: not answered yet"
    assert basics.check_cpu_only_dtype(None) == "exercise 1: not answered yet"
    assert basics.check_runs_on_cpu(None) == "exercise 2: not answered yet"
    assert basics.check_strict_error(None, None) == "exercise 3: not answered yet"


def test_chapter_01_solutions():
    assert basics.check_full_name("/job:worker/replica:0/task:3/device:GPU:1") == \
        "exercise 1: correct"
    assert basics.check_full_name("/job:worker/replica:0/task:3/gpu:1") == "exercise 1: correct"
    assert "not quite" in basics.check_full_name("/job:worker/replica:0/task:3/device:GPU:2")
    assert "not quite" in basics.check_full_name("/job:worker/task:3/device:GPU:1")
    # the inner block's job wins, the outer device stays
    assert basics.check_merge("/job:worker/device:CPU:0") == "exercise 2: correct"
    assert "not quite" in basics.check_merge("/job:ps/device:CPU:0")
    # 3 x 11.4e9 x 1,281,167 x 100 FLOPs at 0.4 x 989.4 TFLOP/s: 3.08 h on one H100, so 4
    hours = 3 * 11.4e9 * 1_281_167 * 100 / (0.4 * 989.4e12) / 3600
    assert 3 < hours < 4
    assert training_cost.check_hours_exercise(4) == "exercise 3: correct"
    assert "not quite" in training_cost.check_hours_exercise(3)
    assert "not quite" in training_cost.check_hours_exercise(5)


def test_chapter_02_solutions(four_devices):
    @tf.function
    def one_copy(x, y):  # the add moves next to its inputs; only the result crosses
        with tf.device("/cpu:0"):
            a = tf.multiply(x, 2.0, name="a")
            b = tf.multiply(y, 3.0, name="b")
            c = tf.add(a, b, name="c")
        with tf.device("/cpu:1"):
            return tf.identity(c)

    x3, ones3 = tf.constant([1.0, 2.0, 3.0]), tf.constant([1.0, 1.0, 1.0])
    assert basics.check_one_copy(one_copy, x3, ones3) == "exercise 1: correct (1 copy)"
    assert basics.check_mul_router(placement.by_op_type({"Mul": "/cpu:1"}, "/cpu:0")) == \
        "exercise 2: correct"
    assert "not yet" in basics.check_mul_router(placement.by_op_type({}, "/cpu:0"))

    @tf.function
    def add_on_cpu1(a, b):  # arguments instead of constants: nothing to fold
        with tf.device("/cpu:1"):
            return tf.add(a, b, name="c")

    a = tf.constant([1.0, 2.0, 3.0])
    assert basics.check_add_on_cpu1(add_on_cpu1, a, a) == "exercise 3: correct"

    @tf.function
    def doubled(a):  # a + a of one argument: Grappler rewrites it (no AddV2 runs)
        with tf.device("/cpu:1"):
            return tf.add(a, a, name="c")

    assert "not yet" in basics.check_add_on_cpu1(doubled, a)

    @tf.function
    def constants_only():
        with tf.device("/cpu:0"):
            a = tf.constant([1.0, 2.0, 3.0], name="a")
        with tf.device("/cpu:1"):
            return tf.add(a, a, name="c")

    assert "not yet" in basics.check_add_on_cpu1(constants_only)


def test_chapter_03_solutions(four_devices):
    assert basics.check_cpu_only_dtype("int8") == "exercise 1: correct"
    assert basics.check_cpu_only_dtype("string") == "exercise 1: correct"
    assert "not quite" in basics.check_cpu_only_dtype("float32")
    assert "example" in basics.check_cpu_only_dtype("int32")

    def cpu_version(raw_ids, tokens, weights):  # cast before the product: int32 has a kernel
        ids, _ = tf.unique(raw_ids)
        label = tf.strings.join(["batch-", tf.strings.as_string(tf.size(ids))])
        scores = tf.linalg.matmul(tf.cast(tokens, tf.int32), tf.cast(tokens, tf.int32))
        return label, tf.linalg.matmul(tf.cast(scores, tf.float32), weights)

    args = (tf.constant([3, 1, 3]), tf.ones((2, 2), tf.uint8), tf.ones((2, 2)))
    assert basics.check_runs_on_cpu(cpu_version, *args).startswith("exercise 2: correct")
    assert basics.check_strict_error("InvalidArgumentError", "call") == "exercise 3: correct"
    assert "not quite" in basics.check_strict_error("InvalidArgumentError", "trace")


def test_inception_run_is_the_chapters_arithmetic():
    """5.7 G multiply-adds per image forward, 2 FLOPs each, x3 with backward, 1,281,167
    images, 100 epochs."""
    from accel.costmodel import steps

    work = steps.training_flops(**training_cost.INCEPTION_V3)
    assert abs(work - 3 * 2 * 5.7e9 * 1_281_167 * 100) < 1e-9 * work
