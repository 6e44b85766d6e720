"""What a parameter-server run leaves behind: one record per gradient, and their analysis.

Versions count updates: the parameters start at version 0 and every applied update adds one.
A worker reads the parameters at ``read_version``; when its gradient reaches the server the
parameters are at ``applied_version``. The difference is the gradient's *staleness*: how many
updates other workers made while this one was computing. Synchronous training has staleness 0 by
construction; asynchronous training measures it. Analysing records needs only NumPy.

Also here: the chapter's small experiments on a toy problem (``toy_problem``), the
``python -m accel bench sync-async`` benchmark and the ``05_staleness.png`` figure, re-exported by
``accel.parameter_server``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["UpdateRecord", "TrainResult", "staleness_histogram", "delay_schedule",
           "summarize", "toy_problem", "bench_sync_async", "figure_staleness"]


@dataclass(frozen=True)
class UpdateRecord:
    """One gradient as the parameter server saw it.

    ``applied_version`` is the version the gradient met on arrival (before its update);
    ``dropped`` gradients (late in K-of-N, or too stale) were not applied. ``loss`` is the
    worker's mini-batch loss at the parameters it read; ``time`` is seconds since the run began.
    """

    worker: int
    read_version: int
    applied_version: int
    loss: float
    time: float
    examples: int
    dropped: bool = False

    @property
    def staleness(self) -> int:
        """Updates applied by others between this gradient's read and its arrival."""
        return self.applied_version - self.read_version


@dataclass
class TrainResult:
    """A finished run: final parameters (NumPy), the records in arrival order, and timings.

    ``curve`` lists ``(examples applied, full-data loss)`` pairs sampled during the run.
    """

    mode: str
    params: list[np.ndarray]
    records: list[UpdateRecord]
    wall_time: float
    final_loss: float
    curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def applied(self) -> list[UpdateRecord]:
        """The records of gradients that changed the parameters."""
        return [r for r in self.records if not r.dropped]

    @property
    def staleness(self) -> np.ndarray:
        """Staleness of every applied gradient, in arrival order."""
        return np.array([r.staleness for r in self.applied], dtype=np.int64)

    @property
    def examples(self) -> int:
        """Examples whose gradients were applied."""
        return sum(r.examples for r in self.applied)

    @property
    def examples_per_s(self) -> float:
        """Throughput: applied examples per second of wall time."""
        return self.examples / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def mean_loss(self) -> float:
        """Mean of the sampled full-data losses (``curve``): the area under the loss curve per
        sample, lower when training gets low sooner. NaN without a curve."""
        return float(np.mean([loss for _, loss in self.curve])) if self.curve else float("nan")

    def dropped_by_worker(self, num_workers: int) -> list[int]:
        """How many gradients of each worker were dropped."""
        counts = [0] * num_workers
        for r in self.records:
            if r.dropped:
                counts[r.worker] += 1
        return counts


def staleness_histogram(records: Sequence[UpdateRecord],
                        max_staleness: int | None = None) -> np.ndarray:
    """``counts[s]`` = number of applied gradients with staleness ``s`` (0..max seen)."""
    values = [r.staleness for r in records if not r.dropped]
    if any(v < 0 for v in values):
        raise ValueError(f"negative staleness in records: {min(values)}; versions are corrupt")
    top = max(values, default=0) if max_staleness is None else max_staleness
    return np.bincount(np.minimum(values, top), minlength=top + 1) if values else np.zeros(1, int)


def summarize(result: TrainResult) -> dict[str, float]:
    """Facts about a run: counts, staleness statistics, throughput and final loss."""
    s = result.staleness
    return {
        "gradients": len(result.records),
        "applied": len(s),
        "dropped": len(result.records) - len(s),
        "max_staleness": int(s.max()) if len(s) else 0,
        "mean_staleness": float(s.mean()) if len(s) else 0.0,
        "stale_fraction": float((s > 0).mean()) if len(s) else 0.0,
        "examples_per_s": result.examples_per_s,
        "final_loss": result.final_loss,
    }


def delay_schedule(steps: int, mean_delay: float, seed: int = 0) -> list[int]:
    """A reproducible list of ``steps`` delays, geometric with the given mean (0 allowed).

    Mimics the long-tailed staleness of real asynchronous runs for the deterministic
    controlled-delay loop (``accel.parameter_server.train_delayed``).
    """
    if steps < 0 or mean_delay < 0:
        raise ValueError(f"steps and mean_delay must be >= 0, got {steps=}, {mean_delay=}")
    rng = np.random.default_rng(seed)
    return [int(d) for d in rng.geometric(1.0 / (1.0 + mean_delay), size=steps) - 1]


def toy_problem(n: int = 768, features: int = 8, hidden: int = 16, seed: int = 0) -> dict:
    """A small learnable regression task and MLP, as keyword arguments for ``train``:
    ``model_fn``, ``loss_fn``, ``params`` (NumPy), ``x``, ``y``."""
    from accel import data, models
    from accel.parameter_server import mse

    x, y, _ = data.regression(n=n, features=features, seed=seed)
    return {"model_fn": models.mlp_apply, "loss_fn": mse,
            "params": models.mlp_init([features, hidden, 1], seed=seed), "x": x, "y": y}


def bench_sync_async(rounds: int = 15, step_time: float = 0.02, factor: float = 4.0) -> dict:
    """``python -m accel bench sync-async``: examples/s of sync, async and K-of-N (K = N - 1)
    with one worker ``factor`` times slower, as ratios to sync without a straggler.

    ps on the first of ``accel.devices.setup(4)``, 3 workers on the others; every step is padded
    to ``step_time`` seconds, so the ratios show scheduling, not the shared CPU cores.
    """
    from accel import devices
    from accel import parameter_server as ps

    names = devices.setup(4)
    workers, n = names[1:], len(names) - 1
    common = dict(toy_problem(), workers=workers, ps_device=names[0], step_time=step_time,
                  optimizer=0.05)
    slow = {n - 1: factor}
    ps.train_sync(**common, steps=1)  # trace every worker's step once, outside the timings
    runs = {"sync": ps.train_sync(**common, steps=rounds),
            "sync, straggler": ps.train_sync(**common, steps=rounds, slowdown=slow),
            "async, straggler": ps.train_async(**common, steps=rounds * n, slowdown=slow),
            f"{n - 1}-of-{n}, straggler": ps.train_k_of_n(**common, k=n - 1, slowdown=slow,
                                                          steps=rounds * n // (n - 1))}
    base = runs["sync"].examples_per_s
    print(f"throughput relative to sync without a straggler ({n} workers, one {factor:g}x slower)")
    out = {}
    for name, result in runs.items():
        out[name] = result.examples_per_s / base
        print(f"  {name:20s} {result.examples_per_s:9.0f} examples/s  {out[name]:5.2f}x")
    return {"ratios": out, "examples_per_s": {k: r.examples_per_s for k, r in runs.items()}}


def figure_staleness(async_result: TrainResult | None = None,
                     delayed: dict[int, TrainResult] | None = None):
    """Left: staleness histogram of an asynchronous run. Right: full-data loss against examples
    for controlled delays ``k`` (``{k: result of train_delayed(..., eval_every=...)}``).
    Missing inputs are computed on ``toy_problem()``."""
    import matplotlib.pyplot as plt

    from accel import devices, viz
    from accel import parameter_server as ps

    names = devices.setup(4)
    common = dict(toy_problem(), workers=names[1:], ps_device=names[0], optimizer=0.02)
    if async_result is None:
        async_result = ps.train_async(**common, steps=300, step_time=0.001)
    if delayed is None:
        delayed = {k: ps.train_delayed(**common, delay=k, steps=300, eval_every=10)
                   for k in (0, 1, 4, 16)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    hist = staleness_histogram(async_result.records)
    left.bar(range(len(hist)), hist, color="#4C72B0")
    left.xaxis.get_major_locator().set_params(integer=True)
    left.set(xlabel="staleness (updates between read and apply)", ylabel="gradients",
             title=f"async, {len(common['workers'])} workers: measured staleness")
    series = {f"delay k={k}": [loss for _, loss in r.curve] for k, r in delayed.items()}
    xs = [ex for ex, _ in next(iter(delayed.values())).curve]
    viz.curves(series, "examples applied", "full-data loss (MSE)", ax=right, x=xs, logy=True,
               title="controlled staleness: harm grows with k")
    fig.tight_layout()
    return fig
