"""Benchmarks run by ``python -m accel bench NAME``; each prints ratios against its own baseline,
measured in the same run. Timings never appear in unit tests."""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["BENCHMARKS", "get", "run"]

# name -> ("module:function", one-line description). The function takes no arguments,
# prints its report and returns the measured numbers as a dict.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "copy-cost": ("accel.copy_cost:bench",
                  "ops hopping between devices; a big tensor used elsewhere (chapter 02)"),
    "memory": ("accel.memory:bench_memory",
               "peak memory and step time: plain vs recompute vs mixed precision (chapter 04)"),
    "sync-async": ("accel.parameter_server:bench_sync_async",
                   "throughput of sync, async and K-of-N with a 4x straggler (chapter 05)"),
    "towers": ("accel.data_parallel_scaling:bench_towers",
               "step time of hand-written towers vs MirroredStrategy vs one device (chapter 06)"),
}


def get(name: str) -> Callable[[], dict]:
    """The benchmark function registered as ``name``."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    module, func = BENCHMARKS[name][0].split(":")
    return getattr(importlib.import_module(module), func)


def run(name: str) -> dict:
    """Run one benchmark and return its numbers."""
    return get(name)()
