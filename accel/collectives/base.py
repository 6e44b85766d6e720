"""What every collective shares: checks of devices and tensors, one value per device, and a way
to record a many-device computation as one differentiable op (``collective_op``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import tensorflow as tf
from tensorflow.python.eager import record

from accel.devices import normalize_device

__all__ = ["check_devices", "check_tensors", "check_axis", "place", "collective_op", "on_device"]


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


def place(values, devices: Sequence[str], make=tf.identity) -> list:
    """One tensor per device: ``values[i]`` on ``devices[i]`` (a list or tuple of arrays or
    tensors), or one value copied to every device. The copy is ``make(value)`` under
    ``tf.device``: a ``tf.identity`` by default, so gradients flow back through it;
    ``make=tf.Variable`` gives a variable on each device (a variable lives where the device
    scope at its creation says, not where its initial value is)."""
    devices = check_devices(devices)
    if not isinstance(values, list | tuple):
        values = [values] * len(devices)
    if len(values) != len(devices):
        raise ValueError(f"got {len(values)} values for {len(devices)} devices")
    out = []
    for value, device in zip(values, devices, strict=True):
        with tf.device(device):
            out.append(make(value))
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


def check_axis(tensors, axis: int, divisible_by: int = 1) -> int:
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
    Variables that ``fn`` reads get their gradients there as well. The same tensor may be passed
    more than once: each argument gets the gradient of its own uses only."""
    @tf.custom_gradient
    def _run(*xs):
        xs = [tf.identity(x) for x in xs]  # one source per argument, even for a repeated tensor
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
