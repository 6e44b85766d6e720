"""Wall-clock timing helpers: median of repeats, and results as ratios against a baseline.

Timings on shared machines are noisy; the course therefore reports *ratios measured in the same
run* and never asserts on a time in a test.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["time_fn", "format_ratios"]


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
