"""Through one device (the parameter-server pattern): ``reduce`` every tensor onto one root
device, then ``broadcast`` the sum back. The root receives and sends ``(n - 1)`` whole tensors;
every other device sends one and receives one."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accel.collectives.base import check_devices, check_tensors, collective_op

__all__ = ["check_root", "reduce", "broadcast", "one_device_sum"]


def check_root(root: int, devices: Sequence[str]) -> int:
    """``root`` as an index into ``devices``; ``ValueError`` if it is not one."""
    n = len(devices)
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < n:
        raise ValueError(f"root must be a device index in [0, {n - 1}], got {root!r}")
    return root


def _reduce_to(tensors, devices, root):
    with tf.device(devices[root]):
        return tf.add_n(tensors) if len(tensors) > 1 else tf.identity(tensors[0])


def _copies(tensor, devices):
    out = []
    for d in devices:
        with tf.device(d):
            out.append(tf.identity(tensor))
    return out


def reduce(tensors: Sequence, devices: Sequence[str], root: int = 0):
    """The sum of ``tensors`` (one per device, equal shapes) on ``devices[root]``: each other
    device sends its tensor there. The gradient is a broadcast from the root."""
    tensors = check_tensors(tensors, devices)
    devices = list(devices)
    root = check_root(root, devices)
    return collective_op("Reduce", tensors, [devices[root]],
                         lambda xs: [_reduce_to(xs, devices, root)],
                         lambda dys: broadcast(dys[0], devices, root))[0]


def broadcast(tensor, devices: Sequence[str], root: int = 0) -> list:
    """A copy of ``tensor`` (living on ``devices[root]``) on every device: the root sends it to
    each of the others. The gradient is a reduce onto the root."""
    devices = check_devices(devices)
    root = check_root(root, devices)
    return collective_op("Broadcast", [tensor], devices,
                         lambda xs: _copies(xs[0], devices),
                         lambda dys: [reduce(dys, devices, root)])


def one_device_sum(tensors: list, devices: list[str], root: int = 0) -> list:
    """All-reduce forward through ``devices[root]``: reduce there, then copy back (no checks,
    no gradient: ``all_reduce(..., algorithm="one_device")`` wraps it)."""
    return _copies(_reduce_to(tensors, devices, root), devices)
