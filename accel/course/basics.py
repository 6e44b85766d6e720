"""Checks for the exercises of chapters 01-03 (devices, placement, kernels).

Each ``check_*`` takes the reader's answer (``None`` until they answer) and returns one line
saying "not answered yet", "correct" or what is still wrong; the solutions live in
``tests/course/test_basics.py``. Exercise 3 of chapter 01 is ``accel.course.training_cost``.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from accel import devices, kernels, placement

__all__ = ["check_full_name", "check_merge", "check_one_copy", "check_mul_router",
           "check_add_on_cpu1", "check_cpu_only_dtype", "check_runs_on_cpu",
           "check_strict_error"]


def _not_yet(n: int, answer) -> str | None:
    return f"exercise {n}: not answered yet" if answer is None else None


def check_full_name(answer: str | None) -> str:
    """01, exercise 1: the fully qualified name of the second GPU of task 3 of job 'worker'."""
    if (msg := _not_yet(1, answer)) is not None:
        return msg
    try:
        spec = devices.parse_device(answer)
    except ValueError as err:
        return f"exercise 1: not a device name: {err}"
    got = (spec.job, spec.replica, spec.task, spec.device_type, spec.device_index)
    if got == ("worker", 0, 3, "GPU", 1):
        return "exercise 1: correct"
    if spec.replica is None:
        return "exercise 1: not quite: a fully qualified name also gives the replica"
    return f"exercise 1: not quite: yours parses as job={got[0]}, task={got[2]}, " \
           f"device={got[3]}:{got[4]}"


def check_merge(answer: str | None) -> str:
    """01, exercise 2: the predicted ``merge_devices("/job:ps/device:CPU:0", "/job:worker")``."""
    if (msg := _not_yet(2, answer)) is not None:
        return msg
    actual = devices.merge_devices("/job:ps/device:CPU:0", "/job:worker")
    try:
        same = devices.normalize_device(answer) == actual
    except ValueError as err:
        return f"exercise 2: not a device name: {err}"
    return "exercise 2: correct" if same else "exercise 2: not quite: run it and compare"


def check_one_copy(fn: Callable, *args) -> str:
    """02, exercise 1: ``fn(*args)`` gives the same result as before with exactly one copy."""
    table = placement.placement_of(fn, *args)
    expected = 2.0 * args[0] + 3.0 * args[1]
    if not bool(tf.reduce_all(tf.abs(table.result - expected) < 1e-6)):
        return "exercise 1: the result changed: keep the arithmetic 2x + 3y"
    n = len(table.transfers)
    return f"exercise 1: correct ({n} copy)" if n == 1 else \
        f"exercise 1: not yet: {n} copies, aim for exactly 1"


def check_mul_router(device_fn: Callable | None) -> str:
    """02, exercise 2: a device function that puts every ``Mul`` on /cpu:1, the rest on /cpu:0."""
    if (msg := _not_yet(2, device_fn)) is not None:
        return msg

    @tf.function
    def probe(x):
        with tf.compat.v1.device(device_fn):
            return tf.sin(x * 2.0) + x * 3.0

    table = placement.placement_of(probe, tf.constant([1.0, 2.0])).without(
        "_Send", "_Recv", "_Arg", "_Retval")
    wrong = [r for r in table if r.device != ("/device:CPU:1" if r.op_type == "Mul"
                                              else "/device:CPU:0")]
    if not wrong:
        return "exercise 2: correct"
    return "exercise 2: not yet: " + ", ".join(f"{r.name} ({r.op_type}) ran on {r.device}"
                                               for r in wrong)


def check_add_on_cpu1(fn: Callable | None, *args) -> str:
    """02, exercise 3: ``fn(*args)`` returns [2, 4, 6] and executes an ``AddV2`` on /cpu:1."""
    if (msg := _not_yet(3, fn)) is not None:
        return msg
    table = placement.placement_of(fn, *args)
    if [float(v) for v in tf.reshape(table.result, [-1])] != [2.0, 4.0, 6.0]:
        return "exercise 3: the result changed: it should still be a + a = [2, 4, 6]"
    adds = [r.device for r in table if r.op_type == "AddV2"]
    if "/device:CPU:1" in adds:
        return "exercise 3: correct"
    return f"exercise 3: not yet: AddV2 ran on {adds or 'no device (it was folded away)'}"


def check_cpu_only_dtype(answer: str | None) -> str:
    """03, exercise 1: a dtype other than int32 with a CPU but no GPU kernel of ``VariableV2``."""
    if (msg := _not_yet(1, answer)) is not None:
        return msg
    try:
        name = tf.as_dtype(answer).name
    except TypeError:
        return f"exercise 1: {answer!r} is not a dtype name"
    table = kernels.registered_kernels("VariableV2")
    on_cpu = table.get("CPU") == ["any"] or name in table.get("CPU", [])
    if name == "int32":
        return "exercise 1: int32 is the example: find another one"
    if on_cpu and name not in table.get("GPU", []):
        return "exercise 1: correct"
    return f"exercise 1: not quite: VariableV2 has a GPU kernel for {name}"


def check_runs_on_cpu(fn: Callable | None, *args) -> str:
    """03, exercise 2: ``fn(*args)`` has no op without a CPU kernel, and runs."""
    if (msg := _not_yet(2, fn)) is not None:
        return msg
    gaps = kernels.kernel_gaps(fn, *args, device_type="CPU")
    if gaps:
        return f"exercise 2: not yet: no CPU kernel for {gaps}"
    fn(*args)
    return "exercise 2: correct (no CPU kernel gap, and it ran)"


def check_strict_error(error_type: str | None, when: str | None) -> str:
    """03, exercise 3: which exception a ``/gpu:0`` pin raises in a ``tf.function`` with soft
    placement off on a machine without a GPU, and whether at trace time or at the call."""
    if (msg := _not_yet(3, error_type)) is not None:
        return msg

    @tf.function
    def pinned(x):
        with tf.device("/gpu:0"):
            return tf.sin(x)

    x = tf.constant([1.0])
    with placement.soft_placement(False):
        stage = "trace"
        try:
            pinned.get_concrete_function(x)
            stage = "call"
            pinned(x)
            stage, raised = "none", "nothing"
        except Exception as err:  # noqa: BLE001 - the exercise asks which one
            raised = type(err).__name__
    if (error_type, when) == (raised, stage):
        return "exercise 3: correct"
    return "exercise 3: not quite: run the experiment and read the exception's type"
