"""Wall-clock timing helpers: median of repeats, and results as ratios against a baseline.

Timings on shared machines are noisy; the course therefore reports *ratios measured in the same
run* and never asserts on a time in a test. A speed-up is read against this machine's own ceiling:
``ceiling()`` is how much faster a matmul runs on two threads than on one, measured in this
process in about half a second (about 2 on two free cores; near 1 when something else keeps a core
busy, or where the two "cores" are hyper-threads of one). Every chapter that stores a timing
prints ``ceiling_line()`` beside it, and ``make execute`` refuses to store outputs when the
ceiling is below ``QUIET_CEILING``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from accel import checks, procs

__all__ = ["time_fn", "format_ratios", "measure_matmul_tflops", "matmul_seconds_with_threads",
           "ceiling", "ceiling_line", "QUIET_CEILING", "CEILING_RANGE", "require_quiet"]

QUIET_CEILING = 1.3  # below this, something else is using the second core
CEILING_RANGE = (QUIET_CEILING, 2.1)  # above 2.1: noise, or more cores than the outputs claim


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
    has ``threads`` threads (the pool is fixed when TensorFlow's runtime starts, hence one
    process per setting; the process starts warm, ``accel.procs``)."""
    checks.positive_int("threads", threads)
    out = procs.run_python(_MATMUL_CODE.format(threads=threads, n=n, repeat=repeat), warm=True)
    seconds, used = out.split()[-2:]
    if int(used) != threads:
        raise RuntimeError(f"the child ran with {used} intra-op threads, not {threads}")
    return float(seconds)


def ceiling(n: int = 1024, repeat: int = 9) -> float:
    """This machine's ceiling for a 2-way speed-up, now: the median time of an ``n`` x ``n``
    float32 matmul on one BLAS thread over its median on two (NumPy's BLAS, its thread count
    set per call with ``threadpoolctl``; TensorFlow's own pools are fixed at start-up, so they
    cannot be switched in a running process). The two settings alternate, ``repeat`` times each
    after a warm-up, so a load that comes and goes hits both. About 2 on two free cores."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    checks.positive_int("n", n)
    checks.positive_int("repeat", repeat)
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    times: dict[int, list[float]] = {1: [], 2: []}
    for k in range(repeat + 2):  # two warm-up rounds: thread start-up, clock ramp
        for threads in (1, 2):
            with threadpool_limits(threads, user_api="blas"):
                start = time.perf_counter()
                a @ a
                if k >= 2:
                    times[threads].append(time.perf_counter() - start)
    return statistics.median(times[1]) / statistics.median(times[2])


def ceiling_line(value: float | None = None) -> str:
    """``ceiling: 1.83 (1-thread / 2-thread matmul time; 2 = two free cores)``: the one line
    of this form a chapter stores beside its timings (measured now unless ``value`` is given)."""
    value = ceiling() if value is None else value
    return f"ceiling: {value:.2f} (1-thread / 2-thread matmul time; 2 = two free cores)"


def require_quiet(minimum: float = QUIET_CEILING, value: float | None = None) -> float:
    """The ceiling now (or ``value``); a ``RuntimeError`` saying what was measured and what is
    needed if it is below ``minimum``: outputs stored now would carry a busy machine's times."""
    value = ceiling() if value is None else value
    if value < minimum:
        raise RuntimeError(
            f"this machine is busy: ceiling {value:.2f} (1-thread / 2-thread matmul time), "
            f"needs >= {minimum:g} to store timings (2 = two free cores). Stop other work "
            "(tests, notebooks, helpers) and re-run.")
    return value
