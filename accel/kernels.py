"""The kernel registry: which op has a kernel for which dtype on which device type.

An op can only run on a device where TensorFlow registered a kernel for the op *and* its dtype.
The registry is queried live, so the answer is the one of the TensorFlow you have installed (the
full ``tensorflow`` wheel lists GPU kernels even on a machine without a GPU; ``tensorflow-cpu``
lists only CPU ones). ``accel.placement`` re-exports both functions.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import kernels, op_def_registry

__all__ = ["registered_kernels", "kernel_gaps"]


def registered_kernels(op_type: str) -> dict[str, list[str]]:
    """Which dtypes op ``op_type`` has kernels for, per device type, from TensorFlow's registry.

    ``{'CPU': ['DT_FLOAT', ...], 'GPU': [...]}``; a kernel with no dtype constraint is listed as
    ``'any'``. (``DEFAULT`` kernels are the device-agnostic ones TensorFlow uses on every device.)
    """
    if not isinstance(op_type, str) or op_def_registry.get(op_type) is None:
        raise ValueError(f"unknown op type {op_type!r}; op types are names such as 'MatMul' "
                         "(see tf.raw_ops)")
    found = kernels.get_registered_kernels_for_op(op_type)
    table: dict[str, set[str]] = {}
    for k in found.kernel:
        names = {tf.dtypes.as_dtype(t).name for c in k.constraint
                 for t in c.allowed_values.list.type} or {"any"}
        table.setdefault(k.device_type, set()).update(names)
    return {dev: sorted(v) for dev, v in sorted(table.items())}


def kernel_gaps(fn, *args, device_type: str = "GPU") -> list[tuple[str, str, str]]:
    """Ops of ``fn``'s graph (traced with ``args``) with no ``device_type`` kernel for their dtype.

    Returns ``(op name, op type, dtype)`` rows: the ops soft placement would move off that device
    (or that fail without it). ``DEFAULT`` kernels count for every device type but CPU.
    """
    graph = tf.function(getattr(fn, "python_function", fn)).get_concrete_function(*args).graph
    gaps = []
    for op in graph.get_operations():
        if op.type in ("Placeholder", "NoOp") or op.type.startswith("_"):
            continue
        dtype = next((op.get_attr(a) for a in ("T", "dtype") if a in op.node_def.attr), None)
        table = registered_kernels(op.type)
        allowed = set(table.get(device_type, []))
        if device_type != "CPU":  # DEFAULT registrations serve the non-CPU devices
            allowed |= set(table.get("DEFAULT", []))
        name = dtype.name if dtype is not None else "any"
        if not allowed or ("any" not in allowed and dtype is not None and name not in allowed):
            gaps.append((op.name, op.type, name))
    return gaps
