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

``sweep(workers, sizes, repeat)`` runs both, always ending every process (timeouts bound each
wait), and returns the median seconds per size.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence

import numpy as np

from accel import timing
from accel.costmodel import collectives as cost
from accel.distributed.cluster import LocalCluster, make_cluster, tf_config
from accel.procs import ChildFailed, run_python, start_python

__all__ = ["KIB", "MIB", "SIZES", "worker", "client", "tf_ring_sweep", "hand_sweep", "sweep",
           "process_lines", "figure_loopback", "main"]

KIB, MIB = 1024, 1024 * 1024
SIZES = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)


def worker(sizes: Sequence[int], repeat: int) -> dict:
    """Run in each worker process (``TF_CONFIG`` set): returns, on every worker, the median
    seconds of both all-reduces per size (the hand ring's only on worker 0)."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.cluster_resolver.task_id
    n = strategy.num_replicas_in_sync

    here = strategy.extended.worker_devices[0]

    def summed(v):  # one replica's all-reduce; a placed value tells it where the result goes
        with tf.device(here):
            v = tf.identity(v)
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, v)

    out: dict = {"sizes": list(sizes), "workers": n, "tf_ring": []}
    for nbytes in sizes:
        x = tf.fill([nbytes // 4], float(rank + 1))

        @tf.function
        def tf_ring(x=x):
            return strategy.run(summed, args=(x,))[-1:]

        got = float(tf_ring().numpy()[0])
        if got != n * (n + 1) / 2:
            raise RuntimeError(f"TF's all-reduce gave {got}, not {n * (n + 1) / 2}")
        out["tf_ring"].append(timing.time_fn(lambda: tf_ring().numpy(), repeat))
    return out


def client(cluster: dict, sizes: Sequence[int], repeat: int) -> dict:
    """Run in a client process next to plain servers: connect to them and time the hand ring,
    its ops under ``/job:worker/task:i``; prints and returns ``{"hand": [...]}``."""
    import tensorflow as tf

    from accel import collectives

    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
    n = len(cluster["worker"])
    devs = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(n)]
    hand = tf.function(lambda xs: [y[-1:] for y in collectives.all_reduce(xs, devs, "ring")])
    out: dict = {"sizes": list(sizes), "workers": n, "hand": []}
    for nbytes in sizes:
        xs = []
        for i, d in enumerate(devs):
            with tf.device(d):
                xs.append(tf.fill([nbytes // 4], float(i + 1)))
        got = [float(v.numpy()[0]) for v in hand(xs)]
        if got != [n * (n + 1) / 2] * n:
            raise RuntimeError(f"the hand ring gave {got}, not {n * (n + 1) / 2}")
        out["hand"].append(timing.time_fn(lambda xs=xs: [v.numpy() for v in hand(xs)], repeat))
    print(json.dumps(out))
    return out


def tf_ring_sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
                  timeout: float = 300.0) -> dict:
    """Start ``workers`` strategy processes, wait for all (bounded by ``timeout`` seconds), end
    them whatever happens, and return worker 0's result."""
    cluster = make_cluster(ps=0, workers=workers)
    args = ["-m", "accel.course.allreduce_procs", "--sizes", *map(str, sizes), "--repeat",
            str(repeat)]
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
    lines = [f"{n} processes on loopback: size, hand ring vs TF RING collective "
             "(median ms; algbw, busbw in MB/s; ratio hand / TF)"]
    ratios = {}
    for s, th, tt in zip(result["sizes"], result["hand"], result["tf_ring"], strict=True):
        ratios[s] = th / tt
        lines.append(f"{_fmt_size(s):>7}  hand {th * 1e3:8.2f} ms {s / th / 1e6:8.1f} "
                     f"{cost.bus_bandwidth(s, th, n) / 1e6:8.1f}   TF {tt * 1e3:8.2f} ms "
                     f"{s / tt / 1e6:8.1f} {cost.bus_bandwidth(s, tt, n) / 1e6:8.1f}   "
                     f"{ratios[s]:.2f}x")
    for name in ("hand", "tf_ring"):
        try:
            a, bw = cost.fit_alpha_beta(result["sizes"], result[name])
        except ValueError:
            lines.append(f"alpha-beta fit ({name}): none (time did not grow with size)")
            continue
        lines.append(f"alpha-beta fit ({name}): {a * 1e3:.2f} ms per call + size / "
                     f"{bw / 1e6:.0f} MB/s")
    return lines, ratios



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
            a, bw = cost.fit_alpha_beta(sizes, t)
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
    args = parser.parse_args(argv)
    if "TF_CONFIG" not in os.environ:
        raise SystemExit("TF_CONFIG is not set: this runs as one worker of a cluster")
    print(json.dumps(worker(args.sizes, args.repeat)), flush=True)


def hand_sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
               timeout: float = 300.0) -> dict:
    """Start ``workers`` plain servers (``LocalCluster``), time the hand ring from a client
    process, end every process; returns the client's result."""
    with LocalCluster(ps=0, workers=workers, lifetime=timeout + 60) as c:
        code = ("from accel.course.allreduce_procs import client; "
                f"client({c.cluster!r}, {list(sizes)!r}, {repeat})")
        text = run_python(code, timeout=timeout)
    return json.loads(text.strip().splitlines()[-1])


def sweep(workers: int = 2, sizes: Sequence[int] = SIZES, repeat: int = 5,
          timeout: float = 300.0) -> dict:
    """Both measurements on the same sizes: ``{"sizes", "workers", "hand", "tf_ring"}``."""
    return {**hand_sweep(workers, sizes, repeat, timeout),
            "tf_ring": tf_ring_sweep(workers, sizes, repeat, timeout)["tf_ring"]}


if __name__ == "__main__":
    main()
