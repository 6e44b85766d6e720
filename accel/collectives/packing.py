"""Fewer, bigger messages and fewer bytes: packing many small gradients into a few all-reduces
(buckets), and sending them as float16.

* ``pack_buckets(sizes, pack_bytes)``: the decision rule, pure: which tensors (by index, in
  order) go into which bucket, each bucket at most ``pack_bytes`` unless one tensor alone is
  bigger. ``pack_bytes=0`` keeps one tensor per bucket. (TensorFlow's
  ``CommunicationOptions(bytes_per_pack=...)`` follows another rule, ``group_by_size`` in
  ``tensorflow/python/distribute/cross_device_utils.py``: a pack closes once it holds MORE than
  ``bytes_per_pack``, and ``0`` means one pack for all, inside a ``tf.function``.)
* ``packed_all_reduce(per_device, devices, pack_bytes, algorithm)``: ``per_device[i]`` is the
  list of tensors on device ``i`` (the same shapes on every device); each bucket is flattened,
  concatenated, all-reduced once and cut back. Returns the reduced lists and the number of
  all-reduces run.
* ``compressed_all_reduce(tensors, devices, algorithm, dtype)``: cast to ``dtype`` (float16
  halves the bytes), all-reduce, cast back to each tensor's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accel import checks
from accel.collectives.base import check_devices
from accel.collectives.direct import all_reduce

__all__ = ["pack_buckets", "packed_all_reduce", "compressed_all_reduce"]


def pack_buckets(sizes: Sequence[int], pack_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` (bytes) grouped, in order, into buckets of at most ``pack_bytes``."""
    checks.non_negative_int("pack_bytes", pack_bytes)
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        checks.non_negative_int(f"sizes[{i}]", size)
        if current and (pack_bytes == 0 or total + size > pack_bytes):
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        buckets.append(current)
    return buckets


def packed_all_reduce(per_device: Sequence[Sequence], devices: Sequence[str],
                      pack_bytes: int = 0, algorithm: str = "ring") -> tuple[list[list], int]:
    """All-reduce every tensor of ``per_device[i]`` (device ``i``'s list) across the devices,
    bucket by bucket; returns ``(reduced lists, number of all-reduces)``."""
    devices = check_devices(devices)
    if len(per_device) != len(devices):
        raise ValueError(f"got {len(per_device)} tensor lists for {len(devices)} devices")
    shapes = [[tuple(t.shape) for t in ts] for ts in per_device]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"tensor shapes differ across devices: {shapes}")
    first = per_device[0]
    sizes = [int(t.shape.num_elements()) * t.dtype.size for t in first]
    buckets = pack_buckets(sizes, pack_bytes)
    out: list[list] = [[None] * len(first) for _ in devices]
    for bucket in buckets:
        flat = []
        for ts, d in zip(per_device, devices, strict=True):
            with tf.device(d):
                parts = [tf.reshape(ts[k], [-1]) for k in bucket]
                flat.append(tf.concat(parts, 0) if len(parts) > 1 else parts[0])
        reduced = all_reduce(flat, devices, algorithm)
        counts = [int(first[k].shape.num_elements()) for k in bucket]
        for i, (y, d) in enumerate(zip(reduced, devices, strict=True)):
            with tf.device(d):
                pieces = tf.split(y, counts) if len(bucket) > 1 else [y]
                for k, piece in zip(bucket, pieces, strict=True):
                    out[i][k] = tf.reshape(piece, first[k].shape)
    return out, len(buckets)


def compressed_all_reduce(tensors: Sequence, devices: Sequence[str], algorithm: str = "ring",
                          dtype=tf.float16) -> list:
    """The all-reduce sent as ``dtype``: each device casts, the collective runs, each device
    casts the sum back. Half the bytes for float16, with float16's rounding (about 3 decimal
    digits) on what is sent and on the partial sums."""
    devices = check_devices(devices)
    low = []
    for t, d in zip(tensors, devices, strict=True):
        with tf.device(d):
            low.append(tf.cast(t, dtype))
    reduced = all_reduce(low, devices, algorithm)
    out = []
    for y, t, d in zip(reduced, tensors, devices, strict=True):
        with tf.device(d):
            out.append(tf.cast(y, t.dtype))
    return out
