"""Collectives written by hand: plain TensorFlow ops under ``tf.device``, one tensor per device.

Every function takes ``tensors`` (a list, one tensor per device, ``tensors[i]`` living on
``devices[i]``) and ``devices`` (distinct device names) and returns a list of the same length,
``result[i]`` placed on ``devices[i]``. They run eagerly and inside ``tf.function``, and they are
differentiable with the exact gradient of what they compute:

* ``all_reduce`` (sum): every device gets ``sum_j tensors[j]``. Its gradient is again an
  all-reduce (of the gradients arriving at each device's result).
* ``all_gather``: every device gets ``concat_j tensors[j]`` along ``axis``. Its gradient is a
  reduce-scatter: part ``j`` of the gradients, summed over the devices, goes back to device ``j``.
* ``reduce_scatter``: device ``j`` gets part ``j`` (along ``axis``) of ``sum_i tensors[i]``.
  Its gradient is an all-gather.

Algorithm: ``"direct"`` (each device sends what the others need straight to them; they add or
concatenate locally, all in the same order, so every device ends with bitwise the same values).
``*_bytes`` give what each device sends, and ``sent_bytes(fn, *args)`` counts it in the graph
that ran (the ``_Send`` nodes of its partition graphs), so the two can be checked against each
other. Chapter 11 adds the other algorithms (through one device, ring, tree) under the same names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record

from accel.devices import normalize_device
from accel.placement import placement_of, short_device

__all__ = ["ALGORITHMS", "check_devices", "check_tensors", "place", "all_reduce", "all_gather",
           "reduce_scatter", "collective_op", "on_device", "all_reduce_bytes",
           "all_gather_bytes", "reduce_scatter_bytes", "sent_bytes"]

ALGORITHMS = ("direct",)


def check_devices(devices: Sequence[str]) -> list[str]:
    """``devices`` as a list; ``ValueError`` if it is empty or names a device twice (in any
    spelling: '/cpu:1' and '/device:CPU:1' are the same device)."""
    devices = list(devices)
    if not devices:
        raise ValueError("devices is empty: a collective needs at least one device")
    seen = Counter(normalize_device(d) for d in devices)
    twice = sorted(d for d, k in seen.items() if k > 1)
    if twice:
        raise ValueError(f"devices lists {twice} more than once: {devices}")
    return devices


def place(values, devices: Sequence[str]) -> list:
    """One tensor per device: ``values[i]`` on ``devices[i]`` (a list or tuple of arrays or
    tensors), or one value copied to every device. The copy is a ``tf.identity`` under
    ``tf.device``, so gradients flow back through it."""
    devices = check_devices(devices)
    if not isinstance(values, list | tuple):
        values = [values] * len(devices)
    if len(values) != len(devices):
        raise ValueError(f"got {len(values)} values for {len(devices)} devices")
    out = []
    for value, device in zip(values, devices, strict=True):
        with tf.device(device):
            out.append(tf.identity(value))
    return out


def check_tensors(tensors: Sequence, devices: Sequence[str], same_shape: bool = True) -> list:
    """Checks one tensor per device and (with ``same_shape``) equal shapes; returns the list."""
    devices = check_devices(devices)
    tensors = list(tensors)
    if len(tensors) != len(devices):
        raise ValueError(f"got {len(tensors)} tensors for {len(devices)} devices: "
                         "pass one tensor per device")
    shapes = [tuple(t.shape) for t in tensors]
    if same_shape and len(set(shapes)) > 1:
        raise ValueError(f"tensor shapes differ across devices: {shapes}")
    return tensors


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")


def _zeros_for(grads, like, devices):
    """Unused outputs get ``None`` gradients: zeros on the output's device instead."""
    out = []
    for g, y, d in zip(grads, like, devices, strict=True):
        with tf.device(d):
            out.append(tf.zeros_like(y) if g is None else g)
    return out


def collective_op(name: str, tensors: Sequence, devices: Sequence[str], forward, backward
                  ) -> list:
    """``forward(tensors)`` (a list in, a list out, one per device) recorded for the gradient tape
    as ONE op whose gradient is ``backward(output_gradients)``, ``None`` gradients replaced by
    zeros on their device. Unlike ``tf.custom_gradient``, which routes every tensor through one
    ``IdentityN`` op (on one device, so in a graph every output would be copied there and back),
    this adds no op: each tensor stays where ``forward`` put it."""
    tensors = list(tensors)
    with record.stop_recording():
        outputs = list(forward(tensors))
    outputs = [tf.identity(y) if any(y is x for x in tensors) else y for y in outputs]

    def grad(*dys):
        return list(backward(_zeros_for(dys, outputs, devices)))

    record.record_operation(name, outputs, tensors, grad)
    return outputs


def on_device(fn, device: str, *tensors):
    """``fn(*tensors)`` run on ``device`` with its gradient computed on ``device`` too.

    Inside ``tf.function`` a ``GradientTape`` puts the gradient ops where ``tape.gradient`` is
    called (its device scope), not next to the forward ops: a backward pass over several devices
    would otherwise run on the default device. This wraps ``fn`` in a ``tf.custom_gradient``
    whose gradient is taken under ``tf.device(device)`` from a tape recorded in the forward pass.
    Variables that ``fn`` reads get their gradients there as well."""
    @tf.custom_gradient
    def _run(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = fn(*xs)

        def grad(*dys, variables=None):
            sources = list(xs) + list(variables or [])
            with tf.device(device):
                gs = tape.gradient(ys, sources, output_gradients=list(dys),
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
            if variables is None:
                return gs
            return gs[:len(xs)], gs[len(xs):]

        return ys, grad

    with tf.device(device):
        return _run(*tensors)


def _sum_on_each(tensors, devices):
    out = []
    for d in devices:
        with tf.device(d):
            out.append(tf.add_n(tensors) if len(tensors) > 1 else tf.identity(tensors[0]))
    return out


def _gather_on_each(tensors, devices, axis):
    out = []
    for d in devices:
        with tf.device(d):
            out.append(tf.concat(tensors, axis) if len(tensors) > 1 else tf.identity(tensors[0]))
    return out


def _scatter_sum(tensors, devices, axis):
    parts = []
    for t, d in zip(tensors, devices, strict=True):
        with tf.device(d):
            parts.append(tf.split(t, len(devices), axis=axis))
    out = []
    for j, d in enumerate(devices):
        with tf.device(d):
            mine = [p[j] for p in parts]
            out.append(tf.add_n(mine) if len(mine) > 1 else tf.identity(mine[0]))
    return out


def _check_axis(tensors, axis: int, divisible_by: int = 1) -> int:
    rank = len(tensors[0].shape)
    if not isinstance(axis, int) or not -rank <= axis < rank:
        raise ValueError(f"axis must be an int in [{-rank}, {rank - 1}] for rank-{rank} "
                         f"tensors, got {axis!r}")
    axis %= rank
    size = tensors[0].shape[axis]
    if size is not None and size % divisible_by:
        raise ValueError(f"axis {axis} has size {size}, not divisible by the {divisible_by} "
                         "devices")
    return axis


def all_reduce(tensors: Sequence, devices: Sequence[str], algorithm: str = "direct") -> list:
    """Every device gets the sum of ``tensors`` (same shapes); the gradient is an all-reduce."""
    tensors = check_tensors(tensors, devices)
    devices = list(devices)
    _check_algorithm(algorithm)
    return collective_op("AllReduce", tensors, devices,
                         lambda xs: _sum_on_each(xs, devices),
                         lambda dys: all_reduce(dys, devices, algorithm))


def all_gather(tensors: Sequence, devices: Sequence[str], axis: int = 0) -> list:
    """Every device gets ``tensors`` concatenated along ``axis`` (equal shapes); the gradient is
    a reduce-scatter."""
    tensors = check_tensors(tensors, devices)
    devices = list(devices)
    axis = _check_axis(tensors, axis)
    return collective_op("AllGather", tensors, devices,
                         lambda xs: _gather_on_each(xs, devices, axis),
                         lambda dys: reduce_scatter(dys, devices, axis))


def reduce_scatter(tensors: Sequence, devices: Sequence[str], axis: int = 0) -> list:
    """Device ``j`` gets part ``j`` of the sum of ``tensors``, split in ``len(devices)`` equal
    parts along ``axis`` (its size must divide); the gradient is an all-gather."""
    tensors = check_tensors(tensors, devices)
    devices = list(devices)
    axis = _check_axis(tensors, axis, len(devices))
    return collective_op("ReduceScatter", tensors, devices,
                         lambda xs: _scatter_sum(xs, devices, axis),
                         lambda dys: all_gather(dys, devices, axis))


def _per_device(nbytes: int, n: int) -> tuple[int, int]:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (the number of devices) must be an int >= 1, got {n!r}")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    return nbytes, n


def all_reduce_bytes(nbytes: int, n: int, algorithm: str = "direct") -> int:
    """Bytes each device sends in ``all_reduce`` of ``nbytes``-byte tensors on ``n`` devices:
    ``direct``: its whole tensor to each of the others, ``(n - 1) * nbytes``."""
    _check_algorithm(algorithm)
    nbytes, n = _per_device(nbytes, n)
    return (n - 1) * nbytes


def all_gather_bytes(nbytes: int, n: int) -> int:
    """Bytes each device sends in ``all_gather`` of ``nbytes``-byte parts: ``(n - 1) * nbytes``."""
    nbytes, n = _per_device(nbytes, n)
    return (n - 1) * nbytes


def reduce_scatter_bytes(nbytes: int, n: int) -> int:
    """Bytes each device sends in ``reduce_scatter`` of ``nbytes``-byte tensors: one part of
    ``nbytes / n`` to each of the others, ``(n - 1) * nbytes / n``."""
    nbytes, n = _per_device(nbytes, n)
    if nbytes % n:
        raise ValueError(f"nbytes={nbytes} does not split into {n} equal parts")
    return (n - 1) * nbytes // n


def sent_bytes(fn, *args) -> dict[str, int]:
    """Run ``fn(*args)`` once (a ``tf.function`` or plain callable) and count, per sending
    device, the bytes of the tensors its ``_Send`` nodes shipped to another device. Sizes come
    from the traced graph's static shapes, so graph rewriting (grappler) is switched off for this
    one run: every send then maps back to a tensor of the traced graph. What ``fn`` returns is
    cut to empty slices on its own devices first, so handing results back ships no bytes (a
    function's outputs are gathered on the default device). Devices that sent nothing are
    absent."""
    inner = getattr(fn, "python_function", fn)

    def emptied(*xs):  # what fn returns, cut to empty slices on their own devices
        out = []
        for y in tf.nest.flatten(inner(*xs)):
            with tf.device(y.device):
                out.append(tf.reshape(y, [-1])[:0])
        return out

    fn = tf.function(emptied)
    previous = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        ran = placement_of(fn, *args)
    finally:
        tf.config.optimizer.set_experimental_options(
            {"disable_meta_optimizer": previous.get("disable_meta_optimizer", False)})
    sent: dict[str, int] = {}
    for gd in ran.graphs:
        made_here = {n.name: n.op for n in gd.node}
        for node in gd.node:
            if node.op != "_Send" or made_here.get(node.input[0].split(":")[0]) == "Const" \
                    and "/ctrl/" in node.input[0]:
                continue  # a control edge crossing devices: an empty dummy tensor is sent
            name = node.input[0] if ":" in node.input[0] else node.input[0] + ":0"
            t = ran.traced.get_tensor_by_name(name)
            if not t.shape.is_fully_defined():
                raise ValueError(f"tensor {name} has no static shape ({t.shape}); cannot count")
            size = int(np.prod(t.shape.as_list(), dtype=np.int64)) * t.dtype.size
            src = short_device(node.attr["send_device"].s.decode())
            sent[src] = sent.get(src, 0) + size
    return sent
