"""Chapter 11's experiments in one process: the hand-written all-reduces next to TensorFlow's
own, the bytes they send, and the chapter's cost-model figure.

* ``tf_all_reduce(name, tensors, devices)``: TensorFlow's implementations on the same tensors:
  ``"ReductionToOneDevice"``, ``"HierarchicalCopyAllReduce"`` and ``"collective"`` (the
  cross-device ops of a ``MirroredStrategy`` over the devices, applied to ``PerReplica``
  values; the collective one is what ``MirroredStrategy`` picks by default here and what
  ``MultiWorkerMirroredStrategy`` runs);
* ``inprocess_times``, ``bytes_table``: the measurements (packing, float16 and local SGD are in
  ``accel.course.traffic``);
* ``figure_alpha_beta()``: modelled all-reduce time of each algorithm on cited links.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import collectives, timing
from accel.costmodel import collectives as cost
from accel.costmodel.hardware import link_bandwidth

__all__ = ["TF_IMPLEMENTATIONS", "tf_strategy", "tf_all_reduce", "placed", "inprocess_times",
           "bytes_table",
           "LINK_CASES", "figure_alpha_beta", "check_exercise"]

TF_IMPLEMENTATIONS = ("ReductionToOneDevice", "HierarchicalCopyAllReduce", "collective")
_STRATEGIES: dict = {}


def placed(device_names: Sequence[str], count: int, seed: int = 0, dtype=np.float32) -> list:
    """``count`` random numbers per device, placed (device i gets its own draw)."""
    rng = np.random.default_rng(seed)
    return collectives.place([rng.standard_normal(count).astype(dtype)
                              for _ in device_names], list(device_names))


class _OwnKeysMirroredStrategy(tf.distribute.MirroredStrategy):
    """A ``MirroredStrategy`` whose collective group keys start at 1001 instead of 1.

    Every ``MirroredStrategy`` numbers its collectives from the same start (group key
    ``1 + _collective_key_base``, instance keys from 100: ``mirrored_strategy.py`` and
    ``CollectiveKeys`` in ``cross_device_utils.py``), so two of them over the same devices in
    one process can have their ``tf.function`` collectives matched with each other's: TF 2.21
    then aborts with "Shape mismatch in the collective instance 100". The course's measuring
    strategy keeps out of the way of the reader's own with this class attribute (which
    TensorFlow reads when it builds the strategy, and sets itself only in its tests)."""

    _collective_key_base = 1000


def tf_strategy(devices: tuple[str, ...], name: str) -> tf.distribute.MirroredStrategy:
    """The ``MirroredStrategy`` over ``devices`` whose cross-device ops are ``name`` (one of
    ``TF_IMPLEMENTATIONS``), made once per process and kept."""
    if (devices, name) not in _STRATEGIES:
        ops = {"ReductionToOneDevice": tf.distribute.ReductionToOneDevice(),
               "HierarchicalCopyAllReduce": tf.distribute.HierarchicalCopyAllReduce(num_packs=1),
               "collective": None}[name]  # None: the default, CollectiveAllReduce
        _STRATEGIES[(devices, name)] = _OwnKeysMirroredStrategy(list(devices),
                                                                cross_device_ops=ops)
    return _STRATEGIES[(devices, name)]


def tf_all_reduce(name: str, tensors: Sequence, devices: Sequence[str]) -> list:
    """The sum of ``tensors`` on every device, computed by the cross-device ops ``name`` (one
    of ``TF_IMPLEMENTATIONS``) of a ``MirroredStrategy`` over ``devices``, applied to the
    ``PerReplica`` value the tensors make. ``"collective"`` is the strategy's default on these
    devices (``CollectiveAllReduce``: ``CollectiveReduceV2`` ops, one per device); TF 2.21
    aborts the process if two such strategies of different sizes run in one process."""
    if name not in TF_IMPLEMENTATIONS:
        raise ValueError(f"name must be one of {list(TF_IMPLEMENTATIONS)}, got {name!r}")
    devices = tuple(collectives.check_devices(devices))
    tensors = collectives.check_tensors(tensors, devices)
    strategy = tf_strategy(devices, name)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tensors[ctx.replica_id_in_sync_group])
    reduced = strategy.extended.reduce_to(tf.distribute.ReduceOp.SUM, values,
                                          destinations=values)
    return list(strategy.experimental_local_results(reduced))


def inprocess_times(device_names: Sequence[str], count: int, repeat: int = 5) -> dict:
    """Median seconds of one all-reduce of ``count`` float32 per device: each hand algorithm
    (as a ``tf.function``) and TensorFlow's cross-device ops (as ``reduce_to`` runs them)."""
    devs = list(device_names)
    xs = placed(devs, count)
    out = {}
    for alg in collectives.ALGORITHMS:
        fn = tf.function(lambda xs, alg=alg: [y[:1] for y in collectives.all_reduce(xs, devs,
                                                                                       alg)])
        out[alg] = timing.time_fn(lambda fn=fn: [v.numpy() for v in fn(xs)], repeat)
    for name in TF_IMPLEMENTATIONS:
        out[f"tf {name}"] = timing.time_fn(
            lambda name=name: [v.numpy()[:1] for v in tf_all_reduce(name, xs, devs)], repeat)
    return out


def bytes_table(device_names: Sequence[str], count: int) -> list[tuple]:
    """``(algorithm, counted bytes per device, formula per device)`` for an all-reduce of
    ``count`` float32 on the devices: counted from the ``_Send`` nodes that ran."""
    devs = list(device_names)
    xs = placed(devs, count)
    rows = []
    for alg in collectives.ALGORITHMS:
        sent = collectives.sent_bytes(lambda xs, alg=alg: collectives.all_reduce(xs, devs, alg),
                                      xs)
        rows.append((alg, [sent.get(d, 0) for d in devs],
                     collectives.all_reduce_bytes_per_device(4 * count, len(devs), alg, 4)))
    return rows


LINK_CASES = (("NVLink 3 (A100, per GPU)", 5e-6), ("PCIe 4.0 x16", 10e-6),
              ("100 Gb Ethernet", 30e-6))


def figure_alpha_beta(n: int = 8):
    """Modelled all-reduce time per algorithm vs message size, on three cited links (latencies
    are assumed values, labelled as such)."""
    import matplotlib.pyplot as plt

    sizes = np.logspace(3, 9, 61)
    fig, axes = plt.subplots(1, len(LINK_CASES), figsize=(13, 3.8), sharey=True)
    for ax, (link, alpha) in zip(axes, LINK_CASES, strict=True):
        bw = link_bandwidth(link)
        for alg in cost.ALGORITHMS:
            ax.loglog(sizes, [cost.allreduce_time(s, n, alg, alpha, bw) for s in sizes],
                      label=alg)
        x = cost.crossover_bytes("tree", "ring", n, alpha, bw)
        ax.axvline(x, color="grey", ls=":")
        ax.set_title(f"{link}\nalpha = {alpha * 1e6:g} us (assumed), n = {n}", fontsize=9)
        ax.set_xlabel("bytes per device")
    axes[0].set_ylabel("modelled seconds")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def check_exercise(number: int, answer) -> str:
    """Exercise 1: bytes each device sends in a ring all-reduce of 1 MiB over 8 devices.
    Exercise 2: the message size (bytes, rounded down) where ring and tree cost the same on 8
    devices with alpha = 10 us and 10 GB/s. Exercise 3: the fewest parameter servers that keep
    16 workers' exchange within 2x of one worker's own link time (``sharded_ps_time``)."""
    if number not in (1, 2, 3):
        raise ValueError(f"number must be 1, 2 or 3, got {number!r}")
    if answer is None:
        return f"exercise {number}: not yet (set answer_{number})"
    if number == 1:
        right = collectives.all_reduce_bytes(1 << 20, 8, "ring")
    elif number == 2:
        right = int(cost.crossover_bytes("tree", "ring", 8, 10e-6, 10e9))
    else:
        one = cost.sharded_ps_time(1e8, 1, 1, 0.0, 1e9)
        right = min(k for k in range(1, 17) if cost.sharded_ps_time(1e8, 16, k, 0.0, 1e9)
                    <= 2 * one)
    if answer == right:
        return f"exercise {number}: right ({right})"
    side = "too high" if answer > right else "too low"
    return f"exercise {number}: not quite ({answer!r} is {side})"
