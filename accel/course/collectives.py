"""Chapter 13's all-reduce experiments, in one process and across processes, and
``python -m accel bench allreduce``.

In one process, on logical devices:

* ``tf_all_reduce(name, tensors, devices)``: TensorFlow's implementations on the same tensors:
  ``"ReductionToOneDevice"``, ``"HierarchicalCopyAllReduce"`` and ``"collective"`` (the
  cross-device ops of a ``MirroredStrategy`` over the devices, applied to ``PerReplica``
  values; the collective one is what ``MirroredStrategy`` picks by default here and what
  ``MultiWorkerMirroredStrategy`` runs);
* ``inprocess_times``, ``bytes_table``: the measurements (packing, float16 and local SGD are in
  ``accel.course.traffic``);
* ``figure_alpha_beta()``: modelled all-reduce time of each algorithm on cited links.

Across real processes on loopback, the same float32 sizes timed two ways:

* ``tf_ring``: ``n`` worker processes, each started with only ``TF_CONFIG``
  (``python -m accel.course.collectives``), each running a ``MultiWorkerMirroredStrategy``
  with RING collectives and timing its all-reduce (``ReplicaContext.all_reduce`` inside
  ``strategy.run``: one ``CollectiveReduceV2`` per worker);
* ``hand``: ``n`` plain servers (``LocalCluster``) and a client process connected to them
  (``tf.config.experimental_connect_to_cluster``) that runs
  ``accel.collectives.all_reduce(..., algorithm="ring")`` with its ops under
  ``/job:worker/task:i``: every chunk crosses from one server process to the next over gRPC.
  (Driving remote ops from inside a strategy's worker crashed TF 2.21 here, and a client's
  ``CollectiveReduceV2`` on plain servers hangs: hence two set-ups.)

Both time ``chain`` (``CHAIN``) all-reduces in a row in one function call, each of the one
before's result, and divide: the call's launch and the fetch of its result are shared, as a
training step shares them over its gradients, and what is left is the all-reduce itself (with
one all-reduce per call the client's launch of remote work, a few milliseconds, dominates the
small sizes). ``sweep(workers, sizes, repeat)`` runs both, always ending every process
(timeouts bound each wait), and returns the median seconds per all-reduce for each size;
``others=("tree", "one_device")`` adds more hand algorithms on the same servers, which
``crossover_lines`` checks the alpha-beta model against.

The benchmark that puts these next to section 6's (``accel.course.traffic``) is
``accel.course.allreduce_bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import collectives, timing
from accel.costmodel import collectives as cost
from accel.costmodel import fit as fitting
from accel.distributed.cluster import LocalCluster, make_cluster, tf_config
from accel.procs import report_and_linger, run_python, start_python, wait_for_reports

__all__ = ["TF_IMPLEMENTATIONS", "tf_strategy", "tf_all_reduce", "placed", "inprocess_times",
           "bytes_table", "collective_bytes_table", "LINK_CASES",
           "figure_alpha_beta", "check_exercise", "PACKS_FOR_0_AND_1", "KIB", "MIB",
           "SIZES", "CHAIN", "worker", "client", "tf_ring_sweep", "hand_sweep", "sweep",
           "process_lines", "crossover_lines", "faster_sizes", "figure_loopback", "main"]

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
        fn = tf.function(lambda xs, alg=alg: [y[:1] for y in collectives.all_reduce(xs, devs, alg)],
                         autograph=False)
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


def collective_bytes_table(device_names: Sequence[str], ns: Sequence[int] = (2, 3, 4),
                           part: int = 12) -> list[tuple]:
    """``(collective, n, counted bytes per device, S, counted / S)`` for the hand all-gather,
    reduce-scatter, all-to-all (``direct``) and the ring all-reduce on the first ``n`` devices,
    ``part`` float32 per device and part, counted from the ``_Send`` nodes that ran. ``S`` is
    nccl-tests' size: the whole gathered (or reduced, or exchanged) array, ``n * part * 4``
    bytes for the first three, one device's tensor for the all-reduce; ``counted / S`` is then
    the bus-bandwidth factor (``cost.BUS_FACTORS``)."""
    rows = []
    for n in ns:
        devs = list(device_names)[:n]
        whole = placed(devs, n * part)
        parts = placed(devs, part)
        cases = (("all_gather", lambda xs, d=devs: collectives.all_gather(xs, d), parts),
                 ("reduce_scatter", lambda xs, d=devs: collectives.reduce_scatter(xs, d), whole),
                 ("all_to_all", lambda xs, d=devs: collectives.all_to_all(xs, d), whole),
                 ("all_reduce", lambda xs, d=devs: collectives.all_reduce(xs, d, "ring"), whole))
        for name, fn, xs in cases:
            sent = collectives.sent_bytes(fn, xs)
            counted = [sent.get(d, 0) for d in devs]
            size = 4 * n * part
            rows.append((name, n, counted, size, max(counted) / size))
    return rows


# (link, assumed latency per message): GPUs of 2024-2026 inside a node, and their networks
LINK_CASES = (("NVLink 4 (H100, per GPU)", 5e-6), ("NVLink 5 (B200, per GPU)", 5e-6),
              ("Infinity Fabric (MI300X, per GPU)", 5e-6),
              ("InfiniBand NDR (400 Gb/s)", 10e-6), ("800 Gb/s network (XDR / ConnectX-8)", 10e-6))


def figure_alpha_beta(n: int = 8):
    """Modelled all-reduce time per algorithm vs message size, on the cited links of
    ``LINK_CASES`` (latencies are assumed values, labelled as such)."""
    import matplotlib.pyplot as plt

    sizes = np.logspace(3, 9, 61)
    fig, axes = plt.subplots(1, len(LINK_CASES), figsize=(16, 3.6), sharey=True)
    for ax, (link, alpha) in zip(axes, LINK_CASES, strict=True):
        bw = cost.link_spec(link).value * 1e9
        for alg in cost.ALGORITHMS:
            ax.loglog(sizes, [cost.allreduce_time(s, n, alg, alpha, bw) for s in sizes],
                      label=alg)
        x = cost.crossover_bytes("tree", "ring", n, alpha, bw)
        ax.axvline(x, color="grey", ls=":")
        ax.set_title(f"{link}\nalpha = {alpha * 1e6:g} us (assumed), n = {n}", fontsize=8)
        ax.set_xlabel("bytes per device")
    axes[0].set_ylabel("modelled seconds")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


# Exercise 2's answer: halving-doubling on 6 devices folds 2 of them onto partners first and
# back at the end (MPICH's non-power-of-two form): 6 steps and factor 2 (3/4) + 2 = 3.5 against
# the ring's 10 steps and 10/6, so the ring wins above (10 - 6) alpha bw / (3.5 - 10/6) bytes.
# Exercise 4's answer, for section 7's MLP (4 Dense layers of 256 and an output: 10 gradients):
# bytes_per_pack=0 is one pack, which waits for everything; bytes_per_pack=1 closes a pack after
# every tensor (TensorFlow's group_by_size), and in the reversed list only the last, d0's kernel,
# waits for d0's weight gradient. tests/course/test_collectives.py checks it against a run.
PACKS_FOR_0_AND_1 = ((1, 1), (10, 1))


def check_exercise(number: int, answer) -> str:
    """Exercise 1: bytes device 0 sends in a ``binomial`` all-reduce of 256 float32 over 3
    devices. Exercise 2: the message size (bytes, rounded down) above which the ring beats
    halving-doubling on 6 devices with alpha = 10 us and 10 GB/s (the cost model). Exercise
    3: the fewest parameter servers that keep 16 workers' exchange of 1e8 bytes each within 2x
    of one worker with one server (``sharded_ps_time(1e8, 16, k, 0.0, 1e9)``: alpha = 0,
    1e9 bytes/s, not pipelined). Exercise 4: for section 7's MLP, ``((collectives, how many
    wait for d0's weight gradient) with bytes_per_pack=0, (the same) with bytes_per_pack=1)``.
    Returns "exercise N: not answered yet" for ``None``, "exercise N: correct (...)" or a
    hint."""
    if number not in (1, 2, 3, 4):
        raise ValueError(f"number must be 1, 2, 3 or 4, got {number!r}")
    if answer is None or answer is ...:
        return f"exercise {number}: not answered yet"
    if number == 4:
        if answer == PACKS_FOR_0_AND_1:
            return f"exercise 4: correct ({PACKS_FOR_0_AND_1})"
        return ("exercise 4: not quite: count the packs TensorFlow makes from the 10 gradients "
                "(group_by_size), then follow the chain from the first one")
    if number == 1:
        right = collectives.all_reduce_bytes_per_device(1024, 3, "binomial")[0]
    elif number == 2:
        right = int(cost.crossover_bytes("halving_doubling", "ring", 6, 10e-6, 10e9))
    else:
        one = cost.sharded_ps_time(1e8, 1, 1, 0.0, 1e9)
        right = min(k for k in range(1, 17) if cost.sharded_ps_time(1e8, 16, k, 0.0, 1e9)
                    <= 2 * one)
    if answer == right:
        return f"exercise {number}: correct ({right})"
    side = "too high" if answer > right else "too low"
    return f"exercise {number}: not quite ({answer!r} is {side})"


KIB, MIB = 1024, 1024 * 1024
SIZES = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
CHAIN = 4  # all-reduces per timed call: the call's dispatch is shared, as a step shares it


def _expected(n: int, chain: int) -> float:
    """What every element holds after ``chain`` chained sums of worker i's ``i + 1``."""
    return n * (n + 1) / 2 * n ** (chain - 1)


def worker(sizes: Sequence[int], repeat: int, chain: int = CHAIN) -> dict:
    """Run in each worker process (``TF_CONFIG`` set): returns the median seconds per
    all-reduce of TF's RING collective for each size, timed as ``chain`` all-reduces in a row
    in one function call, each of the one before's result."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.cluster_resolver.task_id
    n = strategy.num_replicas_in_sync

    here = strategy.extended.worker_devices[0]

    def summed(v):  # `chain` all-reduces in a row, each of the one before's result
        with tf.device(here):  # a placed value tells the all-reduce where results go
            v = tf.identity(v)
        for _ in range(chain):
            v = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, v)
        return v

    out: dict = {"sizes": list(sizes), "workers": n, "chain": chain, "tf_ring": []}
    for nbytes in sizes:
        x = tf.fill([nbytes // 4], float(rank + 1))

        @tf.function(autograph=False)
        def tf_ring(x=x):
            return strategy.run(summed, args=(x,))[-1:]

        got = float(tf_ring().numpy()[0])
        if got != _expected(n, chain):
            raise RuntimeError(f"TF's all-reduce gave {got}, not {_expected(n, chain)}")
        out["tf_ring"].append(timing.time_fn(lambda: tf_ring().numpy(), repeat) / chain)
    return out


def client(cluster: dict, sizes: Sequence[int], repeat: int, chain: int = CHAIN,
           others: Sequence[str] = (), rounds: int = 1) -> dict:
    """Run in a client process next to plain servers: connect to them and time the hand ring,
    its ops under ``/job:worker/task:i``, as ``chain`` all-reduces in a row in one call, each
    of the one before's result; prints and returns ``{"hand": [median seconds per all-reduce,
    ...], "others": {algorithm: [...]}}``, ``others`` naming more hand algorithms
    (``"tree"``, ``"one_device"``) timed the same way on the same processes. With ``rounds``
    above 1 every (size, algorithm) is timed once per round, all of them in turn (so that a
    drift of the shared machine hits all alike), and the median of the rounds' medians kept."""
    import tensorflow as tf

    from accel import collectives

    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
    n = len(cluster["worker"])
    devs = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(n)]

    def chained(algorithm):
        @tf.function(autograph=False)
        def run(xs):  # `chain` all-reduces in a row, each of the one before's result
            for _ in range(chain):
                xs = collectives.all_reduce(xs, devs, algorithm)
            return [x[-1:] for x in xs]
        return run

    fns = {alg: chained(alg) for alg in ("ring", *others)}
    inputs = []
    for nbytes in sizes:
        xs = []
        for i, d in enumerate(devs):
            with tf.device(d):
                xs.append(tf.fill([nbytes // 4], float(i + 1)))
        inputs.append(xs)
        for alg, fn in fns.items():  # checked, then run once more: two untimed calls each
            got = [float(v.numpy()[0]) for v in fn(xs)]
            if got != [_expected(n, chain)] * n:
                raise RuntimeError(f"the hand {alg} gave {got}, not {_expected(n, chain)}")
            _ = [v.numpy() for v in fn(xs)]
    medians: dict = {alg: [[] for _ in sizes] for alg in fns}
    for _ in range(max(1, rounds)):
        for k, xs in enumerate(inputs):
            for alg, fn in fns.items():
                medians[alg][k].append(timing.time_fn(
                    lambda xs=xs, fn=fn: [v.numpy() for v in fn(xs)], repeat, warmup=0) / chain)
    times = {alg: [float(np.median(m)) for m in per_size] for alg, per_size in medians.items()}
    out: dict = {"sizes": list(sizes), "workers": n, "chain": chain, "hand": times.pop("ring"),
                 "others": times}
    print(json.dumps(out))
    return out


def tf_ring_sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
                  timeout: float = 300.0, chain: int = CHAIN) -> dict:
    """Start ``workers`` strategy processes, wait for every report (bounded by ``timeout``
    seconds), then end them all together, whatever happens; return worker 0's result."""
    cluster = make_cluster(ps=0, workers=workers)
    args = ["-m", "accel.course.collectives", "--sizes", *map(str, sizes), "--repeat",
            str(repeat), "--chain", str(chain)]
    children = []
    try:
        for i in range(workers):
            children.append(start_python(args, env={"TF_CONFIG": tf_config(cluster, "worker",
                                                                            i)},
                                         name=f"worker:{i}"))
        return wait_for_reports(children, timeout)[0]
    finally:
        for c in children:
            c.stop(grace=1.0)


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes // (1 << 20)} MiB" if nbytes >= 1 << 20 else f"{nbytes // 1024} KiB"


def process_lines(result: dict) -> tuple[list[str], dict]:
    """Table lines (time, algorithm and bus bandwidth, hand / TF ratio per size) for a
    ``sweep`` result, and the ratios by size."""
    n = result["workers"]
    lines = [f"{n} processes on loopback: size, hand ring vs TF RING collective (median ms per "
             f"all-reduce, {result.get('chain', 1)} in a row per call; algbw, busbw in MB/s; "
             "ratio hand / TF)"]
    ratios = {}
    for s, th, tt in zip(result["sizes"], result["hand"], result["tf_ring"], strict=True):
        ratios[s] = th / tt
        lines.append(f"{_fmt_size(s):>7}  hand {th * 1e3:8.2f} ms {s / th / 1e6:8.1f} "
                     f"{cost.bus_bandwidth(s, th, n) / 1e6:8.1f}   TF {tt * 1e3:8.2f} ms "
                     f"{s / tt / 1e6:8.1f} {cost.bus_bandwidth(s, tt, n) / 1e6:8.1f}   "
                     f"{ratios[s]:.2f}x")
    for name in ("hand", "tf_ring"):
        try:
            a, bw = fitting.fit_alpha_beta(result["sizes"], result[name])
        except ValueError:
            lines.append(f"alpha-beta fit ({name}): none (time did not grow with size)")
            continue
        lines.append(f"alpha-beta fit ({name}): {a * 1e3:.2f} ms per all-reduce + size / "
                     f"{bw / 1e6:.0f} MB/s")
    return lines, ratios



def crossover_lines(result: dict) -> tuple[list[str], dict]:
    """Check the alpha-beta model against a ``hand_sweep(..., others=...)`` result: the hand
    algorithms' median times per size; then, for each medium (``"links"``: every process its
    own link; ``"shared"``: one machine carries every byte), the model fitted to all the points
    (``fit_steps_bytes``), its relative error, and each other algorithm's crossover with the
    ring: predicted by the fit (the crossover size, and the measured sizes below it) vs every
    measured size at which it beat the ring (``faster_sizes``), flagged when those do not form
    one run (the order flips more than once: read such a row against run-to-run variation, not
    as a crossover), and whether prediction and measurement agree. Returns the lines and
    ``{medium: (fit, {algorithm: (predicted crossover bytes, measured faster sizes)})}``."""
    n, sizes = result["workers"], result["sizes"]
    times = {"ring": result["hand"], **result["others"]}
    lines = [f"{n} processes on loopback, hand algorithms from one client (median ms per "
             f"all-reduce, {result.get('chain', 1)} in a row per call)",
             "   size " + "".join(f"{alg:>17}" for alg in times)]
    for i, s in enumerate(sizes):
        lines.append(f"{_fmt_size(s):>7} " + "".join(f"{t[i] * 1e3:17.2f}"
                                                       for t in times.values()))
    checked = {}
    for medium in cost.MEDIA:
        fit = fitting.fit_steps_bytes([(alg, n, s, t) for alg, ts in times.items()
                                    for s, t in zip(sizes, ts, strict=True)], medium)
        unit = "step" if medium == "links" else "message"
        lines.append(f"model, {medium:6} medium: {fit.call * 1e3:.2f} ms + {fit.alpha * 1e3:.3f} ms"
                     f" per {unit} + bytes / {fit.bandwidth / 1e6:.0f} MB/s, relative error "
                     f"{fit.rel_error:.0%}")
        checked[medium] = (fit, {})
        for alg in result["others"]:
            predicted = (cost.crossover_bytes(alg, "ring", n, fit.alpha, fit.bandwidth, medium)
                         if fit.alpha > 0 else 0.0)
            measured = faster_sizes(sizes, times[alg], times["ring"])
            expected = tuple(s for s in sorted(sizes) if s < predicted)
            checked[medium][1][alg] = (predicted, measured)
            grid = f" ({_fmt_sizes(expected, sizes)})" if 0 < predicted < math.inf else ""
            lines.append(f"  {alg} faster than the ring: predicted {_fmt_below(predicted)}"
                         f"{grid}, measured "
                         f"{_fmt_sizes(measured, sizes)}: "
                         f"{'agree' if expected == measured else 'differ'}")
    return lines, checked


def faster_sizes(sizes: Sequence[int], a_seconds: Sequence[float],
                 b_seconds: Sequence[float]) -> tuple[int, ...]:
    """Every size, smallest first, at which algorithm ``a`` measured faster than ``b``."""
    if not len(sizes) == len(a_seconds) == len(b_seconds):
        raise ValueError(f"need equally many sizes and times, got {len(sizes)}, "
                         f"{len(a_seconds)} and {len(b_seconds)}")
    return tuple(s for s, ta, tb in sorted(zip(sizes, a_seconds, b_seconds, strict=True))
                 if ta < tb)


def _fmt_sizes(faster: Sequence[int], sizes: Sequence[int]) -> str:
    """"at every size", "at no size" or the sizes listed; "(flips more than once)" when the
    faster sizes are not one run of neighbouring sizes from either end."""
    grid = sorted(sizes)
    if len(faster) == len(grid):
        return "at every size"
    if not faster:
        return "at no size"
    wins = [s in faster for s in grid]
    flips = sum(a != b for a, b in zip(wins[:-1], wins[1:], strict=True))
    listed = "at " + ", ".join(_fmt_size(s) for s in faster)
    return listed + (" (flips more than once)" if flips > 1 else "")


def _fmt_below(nbytes: float) -> str:
    if nbytes == math.inf:
        return "at every size"
    if nbytes == 0:
        return "at no size"
    return (f"below {nbytes / (1 << 20):.2f} MiB" if nbytes >= 1 << 20
            else f"below {nbytes / 1024:.1f} KiB")


def figure_loopback(result: dict):
    """Measured algorithm bandwidth per size of both all-reduces across processes, with the
    alpha-beta line fitted to each (a figure of a MEASUREMENT: saved by the notebook)."""
    import matplotlib.pyplot as plt

    sizes = np.array(result["sizes"], dtype=float)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, color in (("hand", "C0"), ("tf_ring", "C1")):
        t = np.array(result[name])
        ax.semilogx(sizes, sizes / t / 1e6, "o", color=color, label=f"{name} measured")
        try:
            a, bw = fitting.fit_alpha_beta(sizes, t)
        except ValueError:
            continue
        grid = np.logspace(np.log10(sizes[0]), np.log10(sizes[-1]), 50)
        ax.semilogx(grid, grid / (a + grid / bw) / 1e6, "--", color=color,
                    label=f"{name} fit: {a * 1e3:.1f} ms + S / {bw / 1e6:.0f} MB/s")
    ax.set_xlabel("bytes per process")
    ax.set_ylabel("algorithm bandwidth (MB/s)")
    ax.set_title(f"all-reduce over {result['workers']} processes on loopback")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    """``python -m accel.course.collectives --sizes B ... --repeat R`` (reads
    ``TF_CONFIG``): reports this worker's result (``procs.report_and_linger``)."""
    parser = argparse.ArgumentParser(prog="python -m accel.course.collectives")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chain", type=int, default=CHAIN)
    args = parser.parse_args(argv)
    if "TF_CONFIG" not in os.environ:
        raise SystemExit("TF_CONFIG is not set: this runs as one worker of a cluster")
    report_and_linger(worker(args.sizes, args.repeat, args.chain))


def hand_sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
               timeout: float = 300.0, chain: int = CHAIN, others: Sequence[str] = (),
               rounds: int = 1) -> dict:
    """Start ``workers`` plain servers (``LocalCluster``), time the hand ring (and ``others``)
    from a client process (``client``, ``rounds`` interleaved rounds of ``repeat`` calls), end
    every process; returns the client's result."""
    with LocalCluster(ps=0, workers=workers, lifetime=timeout + 60) as c:
        code = ("from accel.course.collectives import client; "
                f"client({c.cluster!r}, {list(sizes)!r}, {repeat}, {chain}, {tuple(others)!r}, "
                f"{rounds})")
        text = run_python(code, timeout=timeout, warm=True)
    return json.loads(text.strip().splitlines()[-1])


def sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
          timeout: float = 300.0, chain: int = CHAIN, others: Sequence[str] = (),
          rounds: int = 1) -> dict:
    """Both measurements on the same sizes: ``{"sizes", "workers", "chain", "hand", "others",
    "tf_ring"}`` (``others``: more hand algorithms, and ``rounds``, see ``client``)."""
    return {**hand_sweep(workers, sizes, repeat, timeout, chain, others, rounds),
            "tf_ring": tf_ring_sweep(workers, sizes, repeat, timeout, chain)["tf_ring"]}


if __name__ == "__main__":
    main()
