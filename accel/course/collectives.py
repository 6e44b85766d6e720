"""Chapter 11's experiments in one process: the hand-written all-reduces next to TensorFlow's
own, the bytes they send, packing and float16 compression measured, the ``allreduce``
benchmark and the chapter's cost-model figure.

* ``tf_all_reduce(name, tensors, devices)``: TensorFlow's implementations on the same tensors:
  ``"ReductionToOneDevice"``, ``"HierarchicalCopyAllReduce"`` and ``"collective"`` (the
  cross-device ops of a ``MirroredStrategy`` over the devices, applied to ``PerReplica``
  values; the collective one is what ``MirroredStrategy`` picks by default here and what
  ``MultiWorkerMirroredStrategy`` runs);
* ``inprocess_times``, ``packing_times`` (by hand), ``tf_packing`` (``CommunicationOptions``),
  ``fp16_training``: the measurements;
* ``bench(device_names, quick=False)``: ``python -m accel bench allreduce``;
* ``figure_alpha_beta()``: modelled all-reduce time of each algorithm on cited links.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import collectives, data, timing
from accel.costmodel import collectives as cost
from accel.costmodel.hardware import link_bandwidth

__all__ = ["TF_IMPLEMENTATIONS", "tf_all_reduce", "placed", "inprocess_times",
           "bytes_table", "packing_times", "tf_packing", "fp16_training", "bench",
           "LINK_CASES", "figure_alpha_beta", "check_exercise"]

TF_IMPLEMENTATIONS = ("ReductionToOneDevice", "HierarchicalCopyAllReduce", "collective")
_STRATEGIES: dict = {}


def placed(device_names: Sequence[str], count: int, seed: int = 0, dtype=np.float32) -> list:
    """``count`` random numbers per device, placed (device i gets its own draw)."""
    rng = np.random.default_rng(seed)
    return collectives.place([rng.standard_normal(count).astype(dtype)
                              for _ in device_names], list(device_names))


def _strategy(devices: tuple[str, ...], name: str):
    if (devices, name) not in _STRATEGIES:
        ops = {"ReductionToOneDevice": tf.distribute.ReductionToOneDevice(),
               "HierarchicalCopyAllReduce": tf.distribute.HierarchicalCopyAllReduce(num_packs=1),
               "collective": None}[name]  # None: the default, CollectiveAllReduce
        _STRATEGIES[(devices, name)] = tf.distribute.MirroredStrategy(list(devices),
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
    strategy = _strategy(devices, name)
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


def _gradient_like(device_names, tensors_per_device, size, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for d in device_names:
        with tf.device(d):
            out.append([tf.constant(rng.standard_normal(size).astype(np.float32))
                        for _ in range(tensors_per_device)])
    return out


def packing_times(device_names: Sequence[str], tensors: int = 64, size: int = 256,
                  pack_bytes: Sequence[int] = (0, 16 * 1024, 1 << 30), repeat: int = 5
                  ) -> dict:
    """``tensors`` small float32 gradients of ``size`` numbers on each device, all-reduced
    (ring) with each ``pack_bytes``: ``{pack_bytes: (median seconds, number of all-reduces)}``."""
    devs = list(device_names)
    grads = _gradient_like(devs, tensors, size)
    out = {}
    for pack in pack_bytes:
        fn = tf.function(lambda g, pack=pack: [ys[0][:1] for ys in collectives.packed_all_reduce(
            g, devs, pack, "ring")[0]])
        calls = len(collectives.pack_buckets([4 * size] * tensors, pack))
        out[pack] = (timing.time_fn(lambda fn=fn: [v.numpy() for v in fn(grads)], repeat), calls)
    return out


def tf_packing(device_names: Sequence[str], tensors: int = 64, size: int = 256,
               bytes_per_pack: Sequence[int] = (1, 16 * 1024, 0), repeat: int = 5) -> dict:
    """TensorFlow's own packing: ``tensors`` float32 gradients of ``size`` numbers on each
    device, summed in a ``tf.function`` by the collective cross-device ops of a
    ``MirroredStrategy`` (``extended.batch_reduce_to``) with
    ``CommunicationOptions(bytes_per_pack=p)`` for each ``p``. Returns ``{p: (median seconds,
    all-reduces per device)}``, the count read from the traced graph (its ``CollectiveReduce*``
    ops over the number of devices). Raises ``RuntimeError`` if a sum differs from NumPy's."""
    devs = list(device_names)
    grads = _gradient_like(devs, tensors, size)
    strategy = _strategy(tuple(collectives.check_devices(devs)), "collective")
    values = [strategy.experimental_distribute_values_from_function(
        lambda ctx, k=k: grads[ctx.replica_id_in_sync_group][k]) for k in range(tensors)]
    exact = np.sum([[g.numpy() for g in per_device] for per_device in grads], axis=0)
    out = {}
    for pack in bytes_per_pack:
        options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack)
        fn = tf.function(lambda options=options: [
            strategy.experimental_local_results(r)[0] for r in strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, [(v, v) for v in values], options=options)])
        ops = fn.get_concrete_function().graph.get_operations()
        calls = sum(op.type.startswith("CollectiveReduce") for op in ops) // len(devs)
        if not np.allclose([v.numpy() for v in fn()], exact, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"bytes_per_pack={pack}: the sums differ from NumPy's")
        out[pack] = (timing.time_fn(lambda fn=fn: [v.numpy() for v in fn()], repeat), calls)
    return out


def fp16_training(device_names: Sequence[str], steps: int = 30, lr: float = 0.1,
                  seed: int = 0) -> dict:
    """A linear regression trained data-parallel over the devices (each its quarter of the
    batch, gradients all-reduced by ring) with the gradients sent as float32 and as float16:
    ``{"float32": [losses], "float16": [losses]}``."""
    devs = list(device_names)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64 * len(devs), 16)).astype(np.float32)
    y = x @ rng.standard_normal((16, 1)).astype(np.float32) + 0.1
    out = {}
    for name, send in (("float32", lambda g: collectives.all_reduce(g, devs, "ring", "mean")),
                       ("float16", lambda g: [v / len(devs) for v in
                                              collectives.compressed_all_reduce(g, devs)])):
        w = np.zeros((16, 1), np.float32)
        losses = []
        for _ in range(steps):
            grads = []
            for xs, ys, d in zip(np.split(x, len(devs)), np.split(y, len(devs)), devs,
                                 strict=True):
                with tf.device(d):
                    grads.append(tf.constant(2 * xs.T @ (xs @ w - ys) / len(xs)))
            g = send(grads)[0].numpy()
            w = w - lr * g
            losses.append(float(np.mean((x @ w - y) ** 2)))
        out[name] = losses
    return out


def local_sgd_runs(device_names: Sequence[str], everys: Sequence[int] = (1, 2, 4, 8),
                   steps: int = 16, lr: float = 0.05, seed: int = 0) -> dict:
    """Local SGD on a linear regression, one shard of 16 examples per device and step, for each
    ``every``: ``{every: LocalSGDResult}`` (same examples, same steps; only the syncs differ)."""
    from accel.parallel.local_sgd import local_sgd
    from accel.training import squared_error

    devs = list(device_names)
    n, b = len(devs), 16
    x, y, _ = data.regression(n * b * steps, 8, 4, seed=seed)
    shards = [[(x[(n * t + i) * b:(n * t + i + 1) * b], y[(n * t + i) * b:(n * t + i + 1) * b])
               for t in range(steps)] for i in range(n)]
    params = [np.zeros((8, 4), np.float32), np.zeros(4, np.float32)]
    return {k: local_sgd(lambda p, xb: xb @ p[0] + p[1], squared_error, params, shards, devs,
                         every=k, steps=steps, lr=lr, x_eval=x, y_eval=y) for k in everys}


def bench(device_names: Sequence[str], quick: bool = False) -> dict:
    """Across processes: hand ring vs TF's RING collective (goal within 1.1x at every size
    >= 1 MiB); in one process: every algorithm vs TF's; packed vs unpacked; float16 vs
    float32; bytes per device vs the formulas (exact)."""
    from accel.course import allreduce_procs

    devs = list(device_names)
    count = 1024 if quick else 1 << 20
    repeat = 2 if quick else 5
    out: dict = {}
    lines = [f"in one process, {len(devs)} logical CPUs, {4 * count} bytes each (overhead, "
             "not bandwidth: the devices share memory); ratios against the hand ring"]
    times = inprocess_times(devs, count, repeat)
    lines.append(timing.format_ratios(times, "ring"))
    out.update({f"inprocess {k}/ring": v / times["ring"] for k, v in times.items()})
    rows = bytes_table(devs, count // 4 + 1)
    exact = all(c == f for _, c, f in rows)
    out["bytes exact"] = exact
    for alg, counted, formula in rows:
        lines.append(f"bytes sent per device, {alg:10}: counted {counted}, formula {formula}")
    lines.append(f"counted == formula for every algorithm: {exact}")
    tensors = 16 if quick else 64
    for label, key, pack in (
            ("packing by hand, pack_bytes", 0, packing_times(devs, tensors, 256, repeat=repeat)),
            ("TF collective, bytes_per_pack", 1, tf_packing(devs, tensors, 256, repeat=repeat))):
        base = pack[key][0]  # one all-reduce per tensor
        for p, (t, calls) in pack.items():
            out[f"{label} {p}/unpacked"] = t / base
            lines.append(f"{label} {p:>10}: {calls:3} all-reduces, {t * 1e3:8.2f} ms, "
                         f"{t / base:.2f}x unpacked")
    xs = placed(devs, count)
    t32 = timing.time_fn(tf.function(lambda: [y[:1] for y in collectives.all_reduce(
        xs, devs, "ring")]), repeat)
    t16 = timing.time_fn(tf.function(lambda: [y[:1] for y in collectives.compressed_all_reduce(
        xs, devs)]), repeat)
    b32 = collectives.sent_bytes(lambda xs: collectives.all_reduce(xs, devs, "ring"), xs)
    b16 = collectives.sent_bytes(lambda xs: collectives.compressed_all_reduce(xs, devs), xs)
    out["fp16/fp32 time"], out["fp16/fp32 bytes"] = t16 / t32, max(b16.values()) / max(
        b32.values())
    lines.append(f"float16 vs float32 ring: time {out['fp16/fp32 time']:.2f}x, bytes "
                 f"{out['fp16/fp32 bytes']:.2f}x")
    if quick:
        lines.append("processes: skipped with quick=True (start-up alone takes seconds)")
    else:
        worst = 0.0
        for workers in (2, 4):
            others = ("tree", "one_device") if workers == 4 else ()
            result = allreduce_procs.sweep(workers, others=others)
            procs_lines, ratios = allreduce_procs.process_lines(result)
            lines += procs_lines
            out.update({f"procs{workers} {s} hand/tf": r for s, r in ratios.items()})
            worst = max([worst] + [r for s, r in ratios.items() if s >= 1 << 20])
            if others:
                lines += allreduce_procs.crossover_lines(result)[0]
        lines.append(f"goal: hand ring within 1.1x of TF's RING at every size >= 1 MiB -> "
                     f"worst {worst:.2f}x ({'met' if worst <= 1.1 else 'NOT met'})")
    lines.append("this machine's 2-thread vs 1-thread matmul ceiling: "
                 f"{timing.thread_ceiling():.2f}x (virtual CPUs share the cores)")
    print("\n".join(lines))
    return out


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
