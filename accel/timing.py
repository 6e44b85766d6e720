"""Wall-clock timing helpers: median of repeats, and results as ratios against a baseline.

Timings on shared machines are noisy; the course therefore reports *ratios measured in the same
run* and never asserts on a time in a test. A speed-up is read against this machine's own ceiling:
``thread_ceiling()`` is how much faster a matmul runs on two threads than on one (about 2 on two
real cores, less where the two "cores" are hyper-threads of one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from accel import checks, procs

__all__ = ["time_fn", "format_ratios", "measure_matmul_tflops", "matmul_seconds_with_threads",
           "thread_ceiling"]


def time_fn(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs.

    ``fn`` should return something that forces the work (e.g. a ``.numpy()`` value); TensorFlow
    executes eagerly on CPU, but a GPU op returns before it has finished.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got {repeat=}, {warmup=}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def format_ratios(times: dict[str, float], baseline: str, unit: str = "ms") -> str:
    """A small table: each entry's time and its ratio to ``times[baseline]``."""
    if baseline not in times:
        raise ValueError(f"baseline {baseline!r} is not one of {sorted(times)}")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}
    if unit not in scale:
        raise ValueError(f"unit must be one of {sorted(scale)}, got {unit!r}")
    width = max(len(k) for k in times)
    base = times[baseline]
    lines = [f"{k.ljust(width)}  {v * scale[unit]:9.3f} {unit}  {v / base:6.2f}x {baseline}"
             for k, v in times.items()]
    return "\n".join(lines)


def measure_matmul_tflops(n: int = 1024, device: str = "/cpu:0", repeat: int = 5) -> float:
    """Measured float32 matmul throughput of ``device`` in TFLOP/s (2 n^3 FLOPs per product)."""
    import tensorflow as tf

    checks.positive_int("n", n)
    with tf.device(device):
        a = tf.random.stateless_normal((n, n), seed=(0, 1))
        b = tf.random.stateless_normal((n, n), seed=(0, 2))
        seconds = time_fn(lambda: tf.matmul(a, b).numpy(), repeat=repeat)
    return 2 * n**3 / seconds / 1e12


_MATMUL_CODE = """
import time, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads({threads})
x = tf.random.normal(({n}, {n}))
tf.matmul(x, x).numpy()
times = []
for _ in range({repeat}):
    t = time.perf_counter(); tf.matmul(x, x).numpy(); times.append(time.perf_counter() - t)
print(sorted(times)[len(times) // 2], tf.config.threading.get_intra_op_parallelism_threads())
"""


def matmul_seconds_with_threads(threads: int, n: int = 1024, repeat: int = 5) -> float:
    """Median seconds of an ``n`` x ``n`` float32 matmul in a fresh process whose intra-op pool
    has ``threads`` threads (the pool is fixed at start-up, hence one process per setting)."""
    checks.positive_int("threads", threads)
    out = procs.run_python(_MATMUL_CODE.format(threads=threads, n=n, repeat=repeat))
    seconds, used = out.split()[-2:]
    if int(used) != threads:
        raise RuntimeError(f"the child ran with {used} intra-op threads, not {threads}")
    return float(seconds)


def thread_ceiling(n: int = 1024, repeat: int = 5) -> float:
    """This machine's ceiling for a 2-way speed-up: 1-thread / 2-thread matmul time."""
    return matmul_seconds_with_threads(1, n, repeat) / matmul_seconds_with_threads(2, n, repeat)
