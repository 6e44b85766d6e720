"""The kernel registry: which op has a kernel for which dtype on which device type.

An op can only run on a device where TensorFlow registered a kernel for the op *and* its dtype.
The registry is queried live, so the answer is the one of the TensorFlow you have installed (the
full ``tensorflow`` wheel lists GPU kernels even on a machine without a GPU; ``tensorflow-cpu``
lists only CPU ones).

A kernel is registered with one constraint per type attribute of the op: ``Sum`` has ``T`` (the
data) and ``Tidx`` (the type of the axis argument). The data attribute is what "a kernel for
float32" means, so only its constraint is reported (``data_attr`` says which one it is); index
types are a different question, asked with ``attr=``.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import kernels, op_def_registry

__all__ = ["DEVICE_TYPES", "data_attr", "registered_kernels", "host_memory_args",
           "kernel_gaps"]

DEVICE_TYPES = ("CPU", "GPU", "TPU", "DEFAULT")


def _op_def(op_type: str):
    op_def = op_def_registry.get(op_type) if isinstance(op_type, str) else None
    if op_def is None:
        raise ValueError(f"unknown op type {op_type!r}; op types are names such as 'MatMul' "
                         "(see tf.raw_ops)")
    return op_def


def data_attr(op_type: str) -> str | None:
    """The op's type attribute that holds its data type: ``T`` or ``dtype`` where the op has one,
    else its only (or first) type attribute; ``None`` for an op without type attributes."""
    names = [a.name for a in _op_def(op_type).attr if a.type == "type"]
    for preferred in ("T", "dtype"):
        if preferred in names:
            return preferred
    return names[0] if names else None


def _device_type(device_type: str) -> str:
    if not isinstance(device_type, str) or device_type.upper() not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES} (any case), "
                         f"got {device_type!r}")
    return device_type.upper()


def registered_kernels(op_type: str, attr: str | None = None) -> dict[str, list[str]]:
    """Which dtypes op ``op_type`` has kernels for, per device type, from TensorFlow's registry.

    ``{'CPU': ['float32', ...], 'GPU': [...]}`` for the type attribute ``attr`` (default: the data
    attribute, ``data_attr(op_type)``); a kernel that does not constrain it is listed as
    ``'any'``. (``DEFAULT`` kernels are the device-agnostic ones TensorFlow uses on every device.)
    """
    op_def = _op_def(op_type)
    type_attrs = [a.name for a in op_def.attr if a.type == "type"]
    attr = data_attr(op_type) if attr is None else attr
    if attr is not None and attr not in type_attrs:
        raise ValueError(f"op {op_type} has no type attribute {attr!r}; it has {type_attrs}")
    table: dict[str, set[str]] = {}
    for k in kernels.get_registered_kernels_for_op(op_type).kernel:
        names = {tf.dtypes.as_dtype(t).name for c in k.constraint if c.name == attr
                 for t in c.allowed_values.list.type} or {"any"}
        table.setdefault(k.device_type, set()).update(names)
    return {dev: sorted(v) for dev, v in sorted(table.items())}


def host_memory_args(op_type: str, device_type: str = "GPU") -> dict[str, list[str]]:
    """Per dtype of the data attribute, the arguments (inputs and outputs, by their op-definition
    names) that ``op_type``'s ``device_type`` kernel keeps in **host** memory, from the registry
    (``HostMemory(...)`` in the kernel's registration): ``{'int32': ['x', 'y', 'z']}`` for a GPU
    ``AddV2``, whose int32 kernel is the CPU code reading and writing host memory. Dtypes whose
    kernel keeps every argument in device memory are left out."""
    device_type = _device_type(device_type)
    attr = data_attr(op_type)
    table: dict[str, set[str]] = {}
    for k in kernels.get_registered_kernels_for_op(op_type).kernel:
        if k.device_type != device_type or not k.host_memory_arg:
            continue
        names = {tf.dtypes.as_dtype(t).name for c in k.constraint if c.name == attr
                 for t in c.allowed_values.list.type} or {"any"}
        for name in names:
            table.setdefault(name, set()).update(k.host_memory_arg)
    return {dtype: sorted(args) for dtype, args in sorted(table.items())}


def kernel_gaps(fn, *args, device_type: str = "GPU") -> list[tuple[str, str, str]]:
    """Ops of ``fn``'s graph (traced with ``args``) with no ``device_type`` kernel for their dtype.

    ``fn`` is a ``tf.function`` (traced as it is, with its own options such as ``jit_compile``
    or ``input_signature``) or a plain callable (wrapped in one). Returns ``(op name, op type,
    dtype)`` rows: ops whose own dtype has no kernel there. Ops that share a colocation group or a
    resource handle with such an op (or with a variable made outside ``fn``) move with it without
    being listed: the executed graph (``accel.placement.placement_of``) shows where all ran.
    ``DEFAULT`` kernels count for every device type, CPU included: the kernel lookup tries the
    ``DEFAULT`` registration for every device type but the symbolic XLA ones
    (``FindKernelRegistration`` in ``tensorflow/core/framework/op_kernel.cc``).
    """
    device_type = _device_type(device_type)
    function = fn if hasattr(fn, "get_concrete_function") else tf.function(fn)
    graph = function.get_concrete_function(*args).graph
    gaps = []
    for op in graph.get_operations():
        if op.type in ("Placeholder", "NoOp") or op.type.startswith("_"):
            continue
        attr = data_attr(op.type)
        dtype = op.get_attr(attr) if attr is not None and attr in op.node_def.attr else None
        table = registered_kernels(op.type)
        allowed = set(table.get(device_type, [])) | set(table.get("DEFAULT", []))
        name = dtype.name if dtype is not None else "any"
        if not allowed or ("any" not in allowed and dtype is not None and name not in allowed):
            gaps.append((op.name, op.type, name))
    return gaps
