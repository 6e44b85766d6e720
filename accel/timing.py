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

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from accel import checks, procs

__all__ = ["time_fn", "interleaved_medians", "format_ratios", "measure_matmul_tflops",
           "matmul_seconds_with_threads", "Ceiling", "measure_ceiling", "ceiling",
           "ceiling_line", "QUIET_CEILING", "QUIET_OTHERS", "CEILING_RANGE", "require_quiet",
           "lockstep_idle", "measure_lockstep_floor"]

QUIET_CEILING = 1.3  # below this, something else is using the second core
QUIET_OTHERS = 0.35  # cores other processes may use while the ceiling is measured
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


def interleaved_medians(fns: dict, rounds: int = 3, repeat: int = 5, warmup: int = 1
                        ) -> dict:
    """Median seconds of each zero-argument function of ``fns``, timed in interleaved rounds
    (``rounds`` x ``repeat`` calls each, so that drift of the machine hits all alike) after
    ``warmup`` untimed calls of each (the first one traces): the median of the rounds'
    medians, per key."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(time_fn(fn, repeat=repeat, warmup=0))
    return {k: float(statistics.median(v)) for k, v in samples.items()}


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


class Ceiling(NamedTuple):
    """One measurement of how free this machine's two cores are: ``value``, the 1-thread /
    2-thread matmul time (about 2 when both cores are free), and ``others``, the CPU that other
    processes (and, on a virtual machine, its host: steal time) used meanwhile, in cores (about
    0 on a quiet machine, ``None`` where ``/proc/stat`` does not exist)."""

    value: float
    others: float | None


def _busy_seconds() -> float | None:
    """CPU seconds every core spent busy (user, nice, system, irq, softirq, steal) since boot."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure_ceiling(n: int = 1024, repeat: int = 9) -> Ceiling:
    """This machine's ceiling for a 2-way speed-up, now: the median time of an ``n`` x ``n``
    float32 matmul on one BLAS thread over its median on two (NumPy's BLAS, its thread count
    set per call with ``threadpoolctl``; TensorFlow's own pools are fixed at start-up, so they
    cannot be switched in a running process). The two settings alternate, ``repeat`` times each
    after a warm-up, so a load that comes and goes hits both. Meanwhile, the CPU that other
    processes used (``/proc/stat`` minus this process's own time): the ratio alone misses some
    loads (with two busy processes beside it, the one-thread run is slowed too). Threads of this
    process count as its own: work that a chapter leaves running in the background lowers the
    ratio, not ``others``."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    checks.positive_int("n", n)
    checks.positive_int("repeat", repeat)
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    times: dict[int, list[float]] = {1: [], 2: []}
    for k in range(repeat + 2):  # two warm-up rounds: thread start-up, clock ramp
        if k == 2:
            busy0, own0, wall0 = _busy_seconds(), sum(os.times()[:2]), time.perf_counter()
        for threads in (1, 2):
            with threadpool_limits(threads, user_api="blas"):
                start = time.perf_counter()
                a @ a
                if k >= 2:
                    times[threads].append(time.perf_counter() - start)
    busy1, own1, wall1 = _busy_seconds(), sum(os.times()[:2]), time.perf_counter()
    others = None
    if busy0 is not None and busy1 is not None:
        others = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (wall1 - wall0))
    return Ceiling(statistics.median(times[1]) / statistics.median(times[2]), others)


def ceiling(n: int = 1024, repeat: int = 9) -> float:
    """``measure_ceiling(n, repeat).value``: 1-thread / 2-thread matmul time, about 2 on two
    free cores."""
    return measure_ceiling(n, repeat).value


def ceiling_line(measured: Ceiling | float | None = None) -> str:
    """``ceiling: 1.83 (1-thread / 2-thread matmul time; 2 = two free cores); other processes:
    0.02 cores``: the one line of this form a chapter stores beside its timings (measured now
    unless given; a bare number leaves out the other processes)."""
    measured = measure_ceiling() if measured is None else measured
    if not isinstance(measured, Ceiling):
        measured = Ceiling(float(measured), None)
    line = f"ceiling: {measured.value:.2f} (1-thread / 2-thread matmul time; 2 = two free cores)"
    if measured.others is not None:
        line += f"; other processes: {measured.others:.2f} cores"
    return line


def require_quiet(minimum: float = QUIET_CEILING, max_others: float = QUIET_OTHERS,
                  measured: Ceiling | None = None) -> Ceiling:
    """The ceiling now (or ``measured``); a ``RuntimeError`` saying what was measured and what
    is needed if the ratio is below ``minimum`` or other processes used more than
    ``max_others`` cores meanwhile: outputs stored now would carry a busy machine's times."""
    measured = measure_ceiling() if measured is None else measured
    problems = []
    if measured.value < minimum:
        problems.append(f"ceiling {measured.value:.2f} (1-thread / 2-thread matmul time), needs "
                        f">= {minimum:g}")
    if measured.others is not None and measured.others > max_others:
        problems.append(f"other processes used {measured.others:.2f} cores meanwhile, needs "
                        f"<= {max_others:g}")
    if problems:
        raise RuntimeError(f"this machine is busy: {'; '.join(problems)}. Timings stored now "
                           "would be a busy machine's: stop other work (tests, notebooks, "
                           "helpers) and re-run.")
    return measured


def lockstep_idle(works: list[Callable[[], object]], rounds: int = 40, warmup: int = 3) -> float:
    """The idle share of ``works`` (one zero-argument function per thread) run in lock-step:
    each round every thread starts its work at a barrier and the round ends with the last of
    them; idle share = 1 - (the works' summed time) / (threads x the rounds' summed span). Equal
    works on free cores idle little; what they idle here is what jitter alone costs devices that
    wait for each other every round: about the most it costs a pipeline's steady state beyond its
    schedule's bubble (a device waits for its neighbour's task, with some slack). ``warmup``
    rounds are not counted."""
    if len(works) < 2:
        raise ValueError(f"lock-step needs at least 2 works, got {len(works)}")
    checks.positive_int("rounds", rounds)
    checks.non_negative_int("warmup", warmup)
    barrier = threading.Barrier(len(works))
    spans: list[list[tuple[float, float]]] = [[] for _ in works]
    errors: list[BaseException] = []

    def loop(k: int) -> None:
        try:
            for _ in range(warmup + rounds):
                barrier.wait()
                start = time.perf_counter()
                works[k]()
                spans[k].append((start, time.perf_counter()))
        except threading.BrokenBarrierError:
            pass  # another work failed: its error is the one to raise
        except BaseException as exc:  # handed to the caller; the others stop at the barrier
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(len(works))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    busy = span = 0.0
    for r in range(warmup, warmup + rounds):
        intervals = [s[r] for s in spans]
        busy += sum(e - s for s, e in intervals)
        span += max(e for _, e in intervals) - min(s for s, _ in intervals)
    return 1.0 - busy / (len(works) * span)


def _tf_chain(device: str, x, w, layers: int) -> Callable[[], object]:
    """A zero-argument work: ``layers`` ReLU matmuls of ``x`` by ``w``, one call of a concrete
    function traced and called on ``device``."""
    import tensorflow as tf

    with tf.device(device):
        xt, wt = tf.constant(x), tf.constant(w)

        @tf.function(autograph=False)
        def chain(h):
            for _ in range(layers):
                h = tf.nn.relu(tf.matmul(h, wt))
            return h
        concrete = chain.get_concrete_function(xt)  # traced here: its ops on ``device``

    def run():
        with tf.device(device):
            return concrete(xt)
    return run


def measure_lockstep_floor(devices: list[str], rows: int = 128, width: int = 512,
                           layers: int = 8, rounds: int = 40) -> dict[str, float]:
    """``lockstep_idle`` of two equal works, each ``layers`` ReLU matmuls of ``rows`` x
    ``width`` by ``width`` x ``width``: ``"tensorflow"``, one traced function per device of
    ``devices[:2]`` (as a pipeline stage's task runs); ``"numpy"``, the same matmuls in NumPy
    on one BLAS thread each, which no TensorFlow runtime stands between."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)

    def np_work() -> object:
        h = x
        for _ in range(layers):
            h = np.maximum(h @ w, 0.0)
        return h

    out = {"tensorflow": lockstep_idle([_tf_chain(d, x, w, layers) for d in devices[:2]],
                                       rounds)}
    with threadpool_limits(1, user_api="blas"):
        out["numpy"] = lockstep_idle([np_work, np_work], rounds)
    return out
