"""The exercises of chapters 01-03: each check says "not answered yet" for the placeholder the
stored notebook holds, "correct" for the solution written here, and not correct for a wrong one."""

import pytest
import tensorflow as tf

from accel import procs
from accel.course import basics, training_cost


def test_placeholders_are_not_answered_yet(four_devices):
    assert basics.check_merge(None) == "exercise 1: not answered yet"
    assert basics.check_small_matmul(None) == "exercise 2: not answered yet"
    assert basics.check_split_blockers(None) == "exercise 3: not answered yet"
    assert basics.check_one_copy(None) == "exercise 1: not answered yet"
    assert basics.check_variable_read(None, None) == "exercise 2: not answered yet"
    assert basics.check_add_on_cpu1(None) == "exercise 3: not answered yet"
    assert basics.check_soft_fallback(None, None) == "exercise 1: not answered yet"
    assert basics.check_strict_gpu(None, None, None, None) == "exercise 2: not answered yet"


def test_chapter_01_solutions():
    # the inner "/cpu" sets the type and leaves the index open: the outer block's 1 stays
    g = tf.Graph()
    with g.as_default(), tf.device("/gpu:1"), tf.device("/cpu"):
        op = tf.constant(1.0).op
    assert op.device == "/device:CPU:1"
    assert basics.check_merge("/cpu:1").startswith("exercise 1: correct")
    assert "not quite" in basics.check_merge("/device:CPU:0")
    # a 32 x 32 product is all fixed cost: far fewer GFLOP/s than 1024 x 1024 on any CPU
    assert basics.check_small_matmul("more than ten times fewer").startswith(
        "exercise 2: correct")
    assert "not quite" in basics.check_small_matmul("about the same")
    # only listing the logical devices (the runtime's start) blocks a later split
    assert basics.check_split_blockers(["tf.config.list_logical_devices()"]).startswith(
        "exercise 3: correct")
    assert "not quite" in basics.check_split_blockers(
        ["tf.config.list_physical_devices()", "tf.config.list_logical_devices()"])
    assert "not in" in basics.check_split_blockers(["tf.constant(1.0)"])


@pytest.mark.slow
def test_chapter_01_split_blockers_are_tensorflows():
    """The answer of 01's exercise 3, run: each call in SPLIT_CALLS after the import, then a new
    split. One fresh process, the blocking call last (nothing after it could be told apart)."""
    code = """import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
for n, call in enumerate(CALLS, start=2):
    eval(call)
    try:
        split = [tf.config.LogicalDeviceConfiguration()] * n
        tf.config.set_logical_device_configuration(cpu, split)
        print("ok", call)
    except RuntimeError:
        print("blocked", call)
"""
    calls = sorted(basics.SPLIT_CALLS, key=lambda c: c in basics._SPLIT_BLOCKERS)
    out = procs.run_python(f"CALLS = {calls!r}\n" + code, warm=True)  # a fresh runtime
    blocked = {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("blocked")}
    ran = {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(("ok", "blocked"))}
    assert ran == set(basics.SPLIT_CALLS)
    assert blocked == basics._SPLIT_BLOCKERS


def test_chapter_02_solutions(four_devices):
    @tf.function
    def one_copy(x, y):  # the add moves next to its inputs; only the result crosses
        with tf.device("/cpu:0"):
            a = tf.multiply(x, 2.0, name="a")
            b = tf.multiply(y, 3.0, name="b")
            c = tf.add(a, b, name="c")
        with tf.device("/cpu:1"):
            return tf.identity(c)

    @tf.function
    def add_elsewhere(x, y):  # the chapter's function, unchanged: two copies
        with tf.device("/cpu:0"):
            a = tf.multiply(x, 2.0, name="a")
            b = tf.multiply(y, 3.0, name="b")
        with tf.device("/cpu:1"):
            return tf.add(a, b, name="c")

    x3, ones3 = tf.constant([1.0, 2.0, 3.0]), tf.constant([1.0, 1.0, 1.0])
    assert basics.check_one_copy(one_copy, x3, ones3) == "exercise 1: correct (1 copy)"
    assert "2 copies" in basics.check_one_copy(add_elsewhere, x3, ones3)

    with tf.device("/cpu:2"):
        counter = tf.Variable([1.0, 1.0], name="counter")

    @tf.function
    def bump(x):  # the chapter's exercise 2: no request; reads a variable on /cpu:2
        return tf.add(x, counter, name="shifted")

    # called under /cpu:3: the read stays with the variable (rule 1), the add takes the call's
    # device (rule 4), and the value read crosses from /cpu:2 to /cpu:3 once
    assert basics.check_variable_read(bump, ("/cpu:3", 1)).startswith("exercise 2: correct")
    assert "not quite (the device)" in basics.check_variable_read(bump, ("/cpu:2", 1))
    assert "not quite (the number of copies)" in basics.check_variable_read(bump, ("/cpu:3", 0))
    assert "answer with (device, copies)" in basics.check_variable_read(bump, "/cpu:3")
    assert "not a device name" in basics.check_variable_read(bump, ("/tpu:x", 1))

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
    @tf.function
    def fallback(x):  # the chapter's exercise 1: /cpu:7 does not exist here
        with tf.device("/cpu:7"):
            a = tf.multiply(x, 2.0, name="a")
        with tf.device("/cpu:3"):
            return tf.add(a, 1.0, name="b")

    assert basics.check_soft_fallback(fallback, "/cpu:0").startswith("exercise 1: correct")
    assert "(1 copy)" in basics.check_soft_fallback(fallback, "/cpu:0")
    assert "not quite" in basics.check_soft_fallback(fallback, "/cpu:3")

    @tf.function
    def summarize(ids, features, weights):  # the chapter's exercise 2, unchanged
        with tf.device("/gpu:0"):
            distinct, _ = tf.unique(ids)
            label = tf.strings.format("{} distinct ids", tf.size(distinct))
            scores = tf.nn.relu(tf.linalg.matmul(features, weights))
        return label, scores

    @tf.function
    def solution(ids, features, weights):  # the string op goes to the CPU, the rest stays
        with tf.device("/gpu:0"):
            distinct, _ = tf.unique(ids)
            scores = tf.nn.relu(tf.linalg.matmul(features, weights))
        with tf.device("/cpu:0"):
            label = tf.strings.format("{} distinct ids", tf.size(distinct))
        return label, scores

    @tf.function
    def everything_on_cpu(ids, features, weights):  # runs, but not on the GPU
        with tf.device("/cpu:0"):
            distinct, _ = tf.unique(ids)
            label = tf.strings.format("{} distinct ids", tf.size(distinct))
            return label, tf.nn.relu(tf.linalg.matmul(features, weights))

    args = (tf.constant([3, 1, 3]), tf.ones((2, 3)), tf.ones((3, 2)))
    assert "StringFormat" in basics.check_strict_gpu(summarize, *args)
    assert basics.check_strict_gpu(solution, *args).startswith("exercise 2: correct")
    assert "keep the MatMul" in basics.check_strict_gpu(everything_on_cpu, *args)


def test_inception_run_is_the_chapters_arithmetic():
    """5 G multiply-adds per image forward (the Inception-v3 paper), 2 FLOPs each, x3 with
    backward, 1,281,167 images, 100 epochs."""
    from accel.costmodel import steps

    work = steps.training_flops(**training_cost.INCEPTION_V3)
    assert abs(work - 3 * 2 * 5e9 * 1_281_167 * 100) < 1e-9 * work


def test_03_exercise_3_counter_gaps():
    """The answer by hand: inside the function are AssignAddVariableOp (int32 has a DEFAULT
    kernel), ReadVariableOp (a DEFAULT kernel for any dtype), Identity, Const and an int32 Mul
    (a GPU kernel): nothing is missing; the int32 VarHandleOp is outside the traced graph."""
    v = tf.Variable(0)

    @tf.function
    def count(x):
        v.assign_add(x)
        return v.read_value() * 2

    assert basics.check_counter_gaps(None, count, tf.constant(1)) == "exercise 3: not answered yet"
    assert basics.check_counter_gaps([], count, tf.constant(1)).startswith("exercise 3: correct")
    assert "not yet" in basics.check_counter_gaps([("Mul", "Mul", "int32")], count, tf.constant(1))
    assert "answer with a list" in basics.check_counter_gaps("none", count, tf.constant(1))

