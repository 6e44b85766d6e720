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
* ``all_to_all``: device ``j`` gets part ``j`` of every device's tensor, concatenated. Its
  gradient is an all-to-all back.

Algorithm: ``"direct"`` (each device sends what the others need straight to them; they add or
concatenate locally, all in the same order, so every device ends with bitwise the same values).
``*_bytes`` give what each device sends, and ``sent_bytes(fn, *args)`` counts it in the graph
that ran (the ``_Send`` nodes of its partition graphs), so the two can be checked against each
other. Chapter 11 adds the other algorithms (through one device, ring, tree) under the same names.

Modules: ``base`` (checks, ``place``, ``collective_op``, ``on_device``), ``direct`` (the
algorithm above), ``counting`` (bytes: formulas and ``sent_bytes``).
"""

from accel.collectives.base import (
    check_axis,
    check_devices,
    check_tensors,
    collective_op,
    on_device,
    place,
)
from accel.collectives.counting import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    check_sizes,
    reduce_scatter_bytes,
    sent_bytes,
)
from accel.collectives.direct import (
    ALGORITHMS,
    all_gather,
    all_reduce,
    all_to_all,
    check_algorithm,
    reduce_scatter,
)

__all__ = ["ALGORITHMS", "check_devices", "check_tensors", "check_axis", "check_algorithm",
           "check_sizes", "place", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
           "collective_op", "on_device", "all_reduce_bytes", "all_gather_bytes",
           "reduce_scatter_bytes", "all_to_all_bytes", "sent_bytes"]
