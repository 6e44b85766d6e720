"""Checks for the exercises of chapters 01-03 (devices, placement, kernels).

Each ``check_*`` takes the reader's answer (``None`` until they answer) and returns one line
saying "not answered yet", "correct" or what is still wrong; the solutions live in
``tests/course/test_basics.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from accel import devices, kernels, placement, timing

__all__ = ["check_merge", "check_small_matmul", "check_one_copy", "check_variable_read",
           "check_add_on_cpu1", "check_soft_fallback", "check_split_blockers", "check_strict_gpu",
           "has_gpu_kernel", "MATMUL_ANSWERS", "SPLIT_CALLS", "check_counter_gaps"]


def _not_yet(n: int, answer) -> str | None:
    return f"exercise {n}: not answered yet" if answer is None else None


def check_merge(answer: str | None) -> str:
    """01, exercise 1: the predicted requested device of an op created in ``tf.device("/cpu")``
    nested inside ``tf.device("/gpu:1")``, compared with the device TensorFlow's graph records."""
    if (msg := _not_yet(1, answer)) is not None:
        return msg
    g = tf.Graph()
    with g.as_default(), tf.device("/gpu:1"), tf.device("/cpu"):
        actual = tf.constant(1.0).op.device
    try:
        same = devices.normalize_device(answer) == devices.normalize_device(actual)
    except ValueError as err:
        return f"exercise 1: not a device name: {err}"
    if same:
        return ("exercise 1: correct: the inner block set the type and left the index open, so "
                "the outer block's index stayed")
    return "exercise 1: not quite: build the op and compare field by field"


MATMUL_ANSWERS = ("about the same", "a few times fewer", "more than ten times fewer")


def check_small_matmul(answer: str | None) -> str:
    """01, exercise 2: how a 32 x 32 float32 matmul's GFLOP/s compare with a 1024 x 1024 one's on
    this CPU, one of ``MATMUL_ANSWERS`` (measured when the check runs)."""
    if (msg := _not_yet(2, answer)) is not None:
        return msg
    if answer not in MATMUL_ANSWERS:
        return f"exercise 2: answer one of {MATMUL_ANSWERS}"
    ratio = timing.measure_matmul_tflops(1024) / timing.measure_matmul_tflops(32, repeat=21)
    measured = MATMUL_ANSWERS[(ratio >= 2) + (ratio >= 10)]
    if answer == measured:
        return f"exercise 2: correct: the small product got {ratio:.0f}x fewer GFLOP/s here"
    return "exercise 2: not quite: measure both sizes with timing.measure_matmul_tflops(n)"


# 01, exercise 3: calls made after ``import tensorflow`` in a fresh process, and the ones after
# which ``tf.config.set_logical_device_configuration`` raises RuntimeError ("Virtual devices cannot
# be modified after being initialized"). Listing *logical* devices initialises the runtime, which
# creates the devices; listing physical ones (which starts CUDA) does not. Checked in a fresh
# process by tests/course/test_basics.py.
SPLIT_CALLS = ("tf.config.list_physical_devices()", "tf.config.get_visible_devices()",
               "tf.random.set_seed(0)", "tf.config.list_logical_devices()")
_SPLIT_BLOCKERS = frozenset({"tf.config.list_logical_devices()"})


def check_split_blockers(answer) -> str:
    """01, exercise 3: which of ``SPLIT_CALLS`` stop a later split of the CPU into logical
    devices."""
    if (msg := _not_yet(3, answer)) is not None:
        return msg
    if isinstance(answer, str):
        answer = [answer]
    unknown = [a for a in answer if a not in SPLIT_CALLS]
    if unknown:
        return f"exercise 3: not in basics.SPLIT_CALLS: {unknown}"
    if set(answer) == _SPLIT_BLOCKERS:
        return ("exercise 3: correct: only creating the logical devices (the runtime's start) "
                "fixes them; finding the hardware does not")
    return "exercise 3: not quite: try each call in its own fresh process"


def check_one_copy(fn: Callable | None, *args) -> str:
    """02, exercise 1: ``fn(*args)`` gives the same result as ``add_elsewhere`` (2x + 3y) with
    exactly one copy."""
    if (msg := _not_yet(1, fn)) is not None:
        return msg
    table = placement.placement_of(fn, *args)
    expected = 2.0 * args[0] + 3.0 * args[1]
    if not bool(tf.reduce_all(tf.abs(table.result - expected) < 1e-6)):
        return "exercise 1: the result changed: keep the arithmetic 2x + 3y"
    n = len(table.transfers)
    return f"exercise 1: correct ({n} copy)" if n == 1 else \
        f"exercise 1: not yet: {n} copies, aim for exactly 1"


def check_variable_read(fn: Callable, answer) -> str:
    """02, exercise 2: ``answer`` is ``(device, copies)``: the predicted device of the op named
    ``shifted`` (no device request; it adds ``fn``'s argument and a variable that lives on another
    device) and the number of tensors sent between devices, when ``fn`` is called inside
    ``tf.device("/cpu:3")`` on an argument made there."""
    if (msg := _not_yet(2, answer)) is not None:
        return msg
    if not (isinstance(answer, tuple | list) and len(answer) == 2 and isinstance(answer[1], int)):
        return 'exercise 2: answer with (device, copies), e.g. ("/cpu:0", 2)'
    try:
        predicted = devices.normalize_device(answer[0])
    except ValueError as err:
        return f"exercise 2: not a device name: {err}"
    with tf.device("/cpu:3"):
        table = placement.placement_of(fn, tf.constant([1.0, 2.0]))
    device, copies = table.device_of("shifted"), len(table.transfers)
    if (predicted, answer[1]) == (device, copies):
        reads = sorted({r.device for r in table if r.op_type == "ReadVariableOp"})
        return (f"exercise 2: correct: the read ran with the variable ({', '.join(reads)}), the "
                f"add at the call's device, and {copies} tensor{'s' * (copies != 1)} crossed")
    wrong = [what for what, ok in (("the device", predicted == device),
                                   ("the number of copies", answer[1] == copies)) if not ok]
    return (f"exercise 2: not quite ({' and '.join(wrong)}): run placement_of inside the block "
            "and read the table and its transfers")


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


def check_soft_fallback(fn: Callable, answer: str | None) -> str:
    """03, exercise 1: the predicted device of the op named ``a`` in ``fn`` (requested on a device
    that does not exist) under soft placement, compared with the device it ran on."""
    if (msg := _not_yet(1, answer)) is not None:
        return msg
    try:
        predicted = devices.normalize_device(answer)
    except ValueError as err:
        return f"exercise 1: not a device name: {err}"
    with placement.soft_placement(True):
        table = placement.placement_of(fn, tf.constant([0.5, 1.0]))
    if predicted == table.device_of("a"):
        return ("exercise 1: correct: an unmet request falls back to the default device of "
                f"its type, and the result then crosses to b ({len(table.transfers)} copy)")
    return "exercise 1: not quite: run placement_of and read the device column"


def has_gpu_kernel(op) -> bool:
    """Whether ``op`` (a graph operation) has a GPU kernel for its dtype, counting the DEFAULT
    kernels TensorFlow falls back to on a GPU."""
    attr = kernels.data_attr(op.type)
    dtype = op.get_attr(attr).name if attr is not None and attr in op.node_def.attr else None
    table = kernels.registered_kernels(op.type)
    allowed = set(table.get("GPU", [])) | set(table.get("DEFAULT", []))
    return "any" in allowed or (dtype is not None and dtype in allowed) or \
        (dtype is None and bool(allowed))


def check_strict_gpu(fn: Callable | None, ids, features, weights) -> str:
    """03, exercise 2: ``fn(ids, features, weights)`` returns what ``summarize`` returns, keeps its
    ``MatMul`` pinned to a GPU, and every op pinned to a GPU has a GPU kernel (checked against
    the kernel registry; on a machine with a GPU, also run with soft placement off)."""
    if (msg := _not_yet(2, fn)) is not None:
        return msg
    function = fn if hasattr(fn, "get_concrete_function") else tf.function(fn)
    graph = function.get_concrete_function(ids, features, weights).graph
    on_gpu = [op for op in graph.get_operations()
              if tf.DeviceSpec.from_string(op.device).device_type == "GPU"]
    if not any(op.type == "MatMul" for op in on_gpu):
        return "exercise 2: not yet: keep the MatMul pinned to the GPU (that is its point)"
    missing = [f"{op.name} ({op.type})" for op in on_gpu if not has_gpu_kernel(op)]
    if missing:
        return f"exercise 2: not yet: pinned to the GPU without a GPU kernel: {missing}"
    label, scores = function(ids, features, weights)
    n = int(tf.size(tf.unique(ids)[0]))
    same = label.numpy().decode() == f"{n} distinct ids" and bool(tf.reduce_all(
        tf.abs(scores - tf.nn.relu(tf.linalg.matmul(features, weights))) < 1e-5))
    if not same:
        return "exercise 2: the results changed: return the same label and scores"
    if not tf.config.list_physical_devices("GPU"):
        return "exercise 2: correct by the kernel registry (no GPU here to run it strictly)"
    with placement.soft_placement(False):
        function(ids, features, weights)
    return "exercise 2: correct: it ran on this GPU with soft placement off"


def check_counter_gaps(answer, fn: Callable, *args) -> str:
    """03, exercise 3: ``answer`` is what ``kernels.kernel_gaps(fn, *args, device_type="GPU")``
    returns for ``fn``, a function that updates and reads an ``int32`` ``tf.Variable`` made
    outside it (a list of ``(op name, op type, dtype)`` rows; ``[]`` for none)."""
    if (msg := _not_yet(3, answer)) is not None:
        return msg
    if not isinstance(answer, list):
        return "exercise 3: answer with a list of (op name, op type, dtype) rows, [] for none"
    gaps = kernels.kernel_gaps(fn, *args, device_type="GPU")
    if [tuple(row) for row in answer] == gaps:
        return (f"exercise 3: correct: {gaps}; the int32 VarHandleOp (no GPU kernel) runs "
                "outside the function, and the ops that take its handle follow the variable")
    return (f"exercise 3: not yet: {answer} is not it; list the ops inside the traced graph and "
            "read each one's GPU and DEFAULT kernels")
