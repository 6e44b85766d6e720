"""Chapter 11's all-reduce across real processes on loopback, the same float32 sizes timed two
ways:

* ``tf_ring``: ``n`` worker processes, each started with only ``TF_CONFIG``
  (``python -m accel.course.allreduce_procs``), each running a ``MultiWorkerMirroredStrategy``
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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence

import numpy as np

from accel import timing
from accel.costmodel import collectives as cost
from accel.costmodel import fit as fitting
from accel.distributed.cluster import LocalCluster, make_cluster, tf_config
from accel.procs import ChildFailed, run_python, start_python

__all__ = ["KIB", "MIB", "SIZES", "CHAIN", "worker", "client", "tf_ring_sweep", "hand_sweep",
           "sweep", "process_lines", "crossover_lines", "figure_loopback", "main"]

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

        @tf.function
        def tf_ring(x=x):
            return strategy.run(summed, args=(x,))[-1:]

        got = float(tf_ring().numpy()[0])
        if got != _expected(n, chain):
            raise RuntimeError(f"TF's all-reduce gave {got}, not {_expected(n, chain)}")
        out["tf_ring"].append(timing.time_fn(lambda: tf_ring().numpy(), repeat) / chain)
    return out


def client(cluster: dict, sizes: Sequence[int], repeat: int, chain: int = CHAIN,
           others: Sequence[str] = ()) -> dict:
    """Run in a client process next to plain servers: connect to them and time the hand ring,
    its ops under ``/job:worker/task:i``, as ``chain`` all-reduces in a row in one call, each
    of the one before's result; prints and returns ``{"hand": [median seconds per all-reduce,
    ...], "others": {algorithm: [...]}}``, ``others`` naming more hand algorithms
    (``"tree"``, ``"one_device"``) timed the same way on the same processes."""
    import tensorflow as tf

    from accel import collectives

    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
    n = len(cluster["worker"])
    devs = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(n)]

    def chained(algorithm):
        @tf.function
        def run(xs):  # `chain` all-reduces in a row, each of the one before's result
            for _ in range(chain):
                xs = collectives.all_reduce(xs, devs, algorithm)
            return [x[-1:] for x in xs]
        return run

    fns = {alg: chained(alg) for alg in ("ring", *others)}
    times: dict = {alg: [] for alg in fns}
    for nbytes in sizes:
        xs = []
        for i, d in enumerate(devs):
            with tf.device(d):
                xs.append(tf.fill([nbytes // 4], float(i + 1)))
        for alg, fn in fns.items():
            got = [float(v.numpy()[0]) for v in fn(xs)]
            if got != [_expected(n, chain)] * n:
                raise RuntimeError(f"the hand {alg} gave {got}, not {_expected(n, chain)}")
            times[alg].append(
                timing.time_fn(lambda xs=xs, fn=fn: [v.numpy() for v in fn(xs)], repeat) / chain)
    out: dict = {"sizes": list(sizes), "workers": n, "chain": chain, "hand": times.pop("ring"),
                 "others": times}
    print(json.dumps(out))
    return out


def tf_ring_sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
                  timeout: float = 300.0, chain: int = CHAIN) -> dict:
    """Start ``workers`` strategy processes, wait for all (bounded by ``timeout`` seconds), end
    them whatever happens, and return worker 0's result."""
    cluster = make_cluster(ps=0, workers=workers)
    args = ["-m", "accel.course.allreduce_procs", "--sizes", *map(str, sizes), "--repeat",
            str(repeat), "--chain", str(chain)]
    children = []
    try:
        for i in range(workers):
            children.append(start_python(args, env={"TF_CONFIG": tf_config(cluster, "worker",
                                                                            i)},
                                         name=f"worker:{i}"))
        end = time.monotonic() + timeout
        while any(c.alive() for c in children):
            if time.monotonic() > end:
                raise ChildFailed(f"all-reduce workers ran past {timeout:g} s")
            for c in children:
                if not c.alive() and c.popen.returncode != 0:
                    raise ChildFailed(f"{c.name} failed (exit {c.popen.returncode}):\n"
                                      f"{c.output()[1][-1500:]}")
            time.sleep(0.1)
        for c in children:
            if c.popen.returncode != 0:
                raise ChildFailed(f"{c.name} failed (exit {c.popen.returncode}):\n"
                                  f"{c.output()[1][-1500:]}")
        return json.loads(children[0].output()[0].strip().splitlines()[-1])
    finally:
        for c in children:
            c.stop(grace=1.0)


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes // (1 << 20)} MiB" if nbytes >= 1 << 20 else f"{nbytes // 1024} KiB"


def process_lines(result: dict) -> tuple[list[str], dict]:
    """Table lines (time, algorithm and bus bandwidth, hand / TF ratio per size) for a
    ``allreduce_procs.sweep`` result, and the ratios by size."""
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
    ring, predicted by the fit vs read from the timings (``measured_crossover``). Returns the
    lines and ``{medium: (fit, {algorithm: (predicted, measured)})}``."""
    n, sizes = result["workers"], result["sizes"]
    times = {"ring": result["hand"], **result["others"]}
    lines = [f"{n} processes on loopback, hand algorithms from one client (median ms per "
             f"all-reduce, {result.get('chain', 1)} in a row per call)",
             "   size " + "".join(f"{alg:>12}" for alg in times)]
    for i, s in enumerate(sizes):
        lines.append(f"{_fmt_size(s):>7} " + "".join(f"{t[i] * 1e3:12.2f}"
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
            measured = fitting.measured_crossover(sizes, times[alg], times["ring"])
            checked[medium][1][alg] = (predicted, measured)
            lines.append(f"  {alg} faster than the ring: predicted {_fmt_below(predicted)}, "
                         f"measured {_fmt_below(measured)}")
    return lines, checked


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
    """``python -m accel.course.allreduce_procs --sizes B ... --repeat R`` (reads
    ``TF_CONFIG``): prints this worker's result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m accel.course.allreduce_procs")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chain", type=int, default=CHAIN)
    args = parser.parse_args(argv)
    if "TF_CONFIG" not in os.environ:
        raise SystemExit("TF_CONFIG is not set: this runs as one worker of a cluster")
    print(json.dumps(worker(args.sizes, args.repeat, args.chain)), flush=True)


def hand_sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
               timeout: float = 300.0, chain: int = CHAIN, others: Sequence[str] = ()
               ) -> dict:
    """Start ``workers`` plain servers (``LocalCluster``), time the hand ring from a client
    process, end every process; returns the client's result."""
    with LocalCluster(ps=0, workers=workers, lifetime=timeout + 60) as c:
        code = ("from accel.course.allreduce_procs import client; "
                f"client({c.cluster!r}, {list(sizes)!r}, {repeat}, {chain}, {tuple(others)!r})")
        text = run_python(code, timeout=timeout)
    return json.loads(text.strip().splitlines()[-1])


def sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
          timeout: float = 300.0, chain: int = CHAIN, others: Sequence[str] = ()) -> dict:
    """Both measurements on the same sizes: ``{"sizes", "workers", "chain", "hand", "others",
    "tf_ring"}`` (``others``: more hand algorithms, see ``client``)."""
    return {**hand_sweep(workers, sizes, repeat, timeout, chain, others),
            "tf_ring": tf_ring_sweep(workers, sizes, repeat, timeout, chain)["tf_ring"]}


if __name__ == "__main__":
    main()
