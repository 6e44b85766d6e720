"""Chapter 05's experiments: a toy problem for the parameter server, the sync-async benchmark
and the ``05_staleness.png`` figure."""

from __future__ import annotations

from collections.abc import Sequence

from accel import data, devices, models, viz
from accel.parallel import parameter_server as ps
from accel.parallel.staleness import TrainResult, staleness_histogram
from accel.training import squared_error

__all__ = ["toy_problem", "bench_sync_async", "figure_staleness"]


def toy_problem(n: int = 768, features: int = 8, hidden: int = 16, seed: int = 0) -> dict:
    """A small learnable regression task and MLP, as keyword arguments for ``train``:
    ``model_fn``, ``loss_fn``, ``params`` (NumPy), ``x``, ``y``."""
    x, y, _ = data.regression(n=n, features=features, seed=seed)
    return {"model_fn": models.mlp_apply, "loss_fn": squared_error,
            "params": models.mlp_init([features, hidden, 1], seed=seed), "x": x, "y": y}


def bench_sync_async(device_names: Sequence[str], quick: bool = False, rounds: int = 15,
                     step_time: float = 0.02, factor: float = 4.0) -> dict:
    """``python -m accel bench sync-async``: examples/s of sync, async and K-of-N (K = N - 1)
    with one worker ``factor`` times slower, as ratios to sync without a straggler.

    ps on the first device, workers on the others; every step is padded to ``step_time``
    seconds, so the ratios show scheduling, not the shared CPU cores. Throughput counts the
    examples of applied updates up to the last applied update (``TrainResult.wall_time``).
    """
    names = list(device_names)
    rounds = 2 if quick else rounds
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
