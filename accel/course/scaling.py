"""Chapter 07's experiments: how data parallelism scales, measured (towers vs MirroredStrategy vs
one device), and the batch-size side (the linear scaling rule tried on a toy problem).

* ``timed_steps(n, ...)``: the three training steps for ``n`` devices, ready to time;
* ``measure_scaling(counts)``: step time and examples/s for 1, 2, 4 devices, by hand and with
  MirroredStrategy, measured in one run (interleaved, medians);
* ``format_scaling(results)``: that as a table of step times and ratios;
* ``bench_towers()``: the ``python -m accel bench towers`` report (ratios for 2 and 4 devices);
* ``figure_scaling(results)``: the plot of ``measure_scaling`` (the chapter saves it as the
  measured ``images/07_scaling.png``);
* ``final_loss``: the loss a batch size and learning rate reach (the linear scaling rule tried);
* ``check_update_scale``, ``check_compute_for_80``, ``check_parallel_calls``: the exercises.

The cost model of a step on real accelerators is ``accel.costmodel.steps``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from accel import checks, data, devices, models, timing
from accel.costmodel.steps import data_parallel_step_time
from accel.parallel.data import make_single_step, make_tower_step, split_batch
from accel.parallel.mirrored import make_mirrored_step, mirrored_strategy
from accel.training import squared_error

__all__ = ["BENCH_SIZES", "timed_steps", "measure_scaling", "format_scaling", "bench_towers",
           "figure_scaling", "final_loss", "check_update_scale", "check_compute_for_80",
           "check_parallel_calls"]

BENCH_SIZES = (128, 512, 512, 16)  # MLP layer widths used for timing
VARIANTS = ("single", "towers", "mirrored")


def timed_steps(n: int, device_names: Sequence[str], per_device_batch: int = 256,
                sizes: Sequence[int] = BENCH_SIZES, lr: float = 0.01) -> dict[str, Callable]:
    """Zero-argument callables running one training step each, on a global batch of
    ``n * per_device_batch``: ``single`` (all of it on ``device_names[0]``), ``towers``
    (``make_tower_step`` over the first ``n`` devices) and ``mirrored`` (a MirroredStrategy
    custom-loop step over the same devices). Each returns the loss as a NumPy value. Both
    parallel steps get their input already split, each shard on its device (as
    ``experimental_distribute_dataset`` hands it to MirroredStrategy), so neither pays for the
    split inside the timed step."""
    if n < 1 or n > len(device_names):
        raise ValueError(f"n must be in 1..{len(device_names)} (the devices given), got {n}")
    sizes = list(sizes)
    global_batch = n * per_device_batch
    x, y, _ = data.regression(global_batch, sizes[0], sizes[-1], seed=n)
    with tf.device(device_names[0]):
        xt, yt = tf.constant(x), tf.constant(y)
    params = models.mlp_init(sizes, seed=0)
    single = make_single_step(models.mlp_apply, squared_error, params, lr, device_names[0])
    towers = make_tower_step(models.mlp_apply, squared_error, params, lr, device_names[:n])
    strategy = mirrored_strategy(device_names[:n])
    with strategy.scope():
        model = models.keras_mlp(sizes, seed=0)
        optimizer = tf.keras.optimizers.SGD(lr)
    mirrored = make_mirrored_step(strategy, model, squared_error, optimizer, global_batch)
    ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, y)))
    batch = next(iter(ds))
    shards = []
    for device, (xs, ys) in zip(device_names[:n], split_batch((x, y), n), strict=True):
        with tf.device(device):
            shards.append((tf.identity(xs), tf.identity(ys)))
    xs, ys = (tuple(part) for part in zip(*shards, strict=True))
    return {"single": lambda: single(xt, yt).numpy(),
            "towers": lambda: towers(xs, ys).numpy(),
            "mirrored": lambda: mirrored(batch).numpy()}


def _median_times(steps: dict, rounds: int, repeat: int) -> dict:
    """Interleave the variants (``rounds`` x ``repeat`` calls each) so drift hits all alike."""
    for fn in steps.values():
        fn()  # trace and warm up
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            samples[name].append(timing.time_fn(fn, repeat=repeat, warmup=0))
    return {k: float(np.median(v)) for k, v in samples.items()}


def measure_scaling(device_names: Sequence[str], counts: Sequence[int] = (1, 2, 4),
                    per_device_batch: int = 256, sizes: Sequence[int] = BENCH_SIZES,
                    rounds: int = 3, repeat: int = 5) -> dict:
    """Median step time (s) of each variant for each device count, and examples per second.

    Weak scaling: every device gets ``per_device_batch`` examples, so the global batch grows
    with the device count. All variants and counts are timed in interleaved rounds. Returns
    ``{"counts": [...], "per_device_batch": b, "step_s": {variant: [...]},
    "examples_per_s": {variant: [...]}}``.
    """
    steps = {(v, n): fn for n in counts
             for v, fn in timed_steps(n, device_names, per_device_batch, sizes).items()}
    times = _median_times(steps, rounds, repeat)
    step_s = {v: [times[(v, n)] for n in counts] for v in VARIANTS}
    eps = {v: [n * per_device_batch / t for n, t in zip(counts, ts, strict=True)]
           for v, ts in step_s.items()}
    return {"counts": list(counts), "per_device_batch": per_device_batch, "step_s": step_s,
            "examples_per_s": eps}


def format_scaling(res: dict) -> str:
    """``measure_scaling``'s result as text: step times, examples/s against one device, and
    the towers / MirroredStrategy ratio, per device count."""
    lines = ["devices   " + "".join(f"{n:>10}" for n in res["counts"])]
    for v in VARIANTS:
        lines.append(f"{v:10}" + "".join(f"{t * 1e3:>8.1f}ms" for t in res["step_s"][v]))
    for v in ("towers", "mirrored"):
        eps = res["examples_per_s"][v]
        lines.append(f"{v:10} examples/s vs 1 device: "
                     + "  ".join(f"{e / eps[0]:.2f}x" for e in eps))
    pairs = zip(res["step_s"]["towers"], res["step_s"]["mirrored"], strict=True)
    lines.append("towers / MirroredStrategy step time: "
                 + "  ".join(f"{a / b:.2f}" for a, b in pairs))
    return "\n".join(lines)


def bench_towers(device_names: Sequence[str], quick: bool = False,
                 counts: Sequence[int] = (2, 4), per_device_batch: int = 256) -> dict:
    """Step time of hand-written towers vs MirroredStrategy vs one device, for 2 and 4 devices,
    as ratios measured in one run. Prints a table and returns ``{"<variant>_<n>": seconds,
    "towers/mirrored_<n>": ratio, "towers/single_<n>": ratio}``."""
    res = measure_scaling(device_names, counts, 16 if quick else per_device_batch,
                          rounds=1 if quick else 3, repeat=1 if quick else 5)
    out: dict[str, float] = {}
    lines = [f"global batch = n x {per_device_batch}; MLP {list(BENCH_SIZES)}; median step time",
             f"{'devices':>7}  {'single':>9}  {'towers':>9}  {'mirrored':>9}  "
             f"{'towers/mirrored':>15}  {'towers/single':>13}"]
    for i, n in enumerate(counts):
        t = {v: res["step_s"][v][i] for v in VARIANTS}
        out.update({f"{v}_{n}": t[v] for v in VARIANTS})
        out[f"towers/mirrored_{n}"] = t["towers"] / t["mirrored"]
        out[f"towers/single_{n}"] = t["towers"] / t["single"]
        lines.append(f"{n:>7}  {t['single'] * 1e3:>7.1f}ms  {t['towers'] * 1e3:>7.1f}ms  "
                     f"{t['mirrored'] * 1e3:>7.1f}ms  {out[f'towers/mirrored_{n}']:>15.2f}  "
                     f"{out[f'towers/single_{n}']:>13.2f}")
    worst = max(out[f"towers/mirrored_{n}"] for n in counts)
    lines.append(f"target: towers within 1.1x of MirroredStrategy -> worst ratio {worst:.2f} "
                 f"({'met' if worst <= 1.1 else 'NOT met'})")
    print("\n".join(lines))
    return out


def figure_scaling(results: dict | None = None):
    """Step time and examples/s against the number of devices, towers vs MirroredStrategy
    (``results`` from ``measure_scaling``; measured now when omitted)."""
    import matplotlib.pyplot as plt

    res = results if results is not None else measure_scaling(devices.setup(4))
    counts = res["counts"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for v, style in (("towers", "o-"), ("mirrored", "s--")):
        label = "by hand (towers)" if v == "towers" else "MirroredStrategy"
        ax1.plot(counts, [t * 1e3 for t in res["step_s"][v]], style, label=label)
        ax2.plot(counts, res["examples_per_s"][v], style, label=label)
    base = res["examples_per_s"]["towers"][0]
    ax2.plot(counts, [base * n / counts[0] for n in counts], ":", color="grey",
             label="ideal (linear)")
    ax1.set(xlabel="devices", ylabel="step time (ms)", xticks=counts,
            title=f"step time, {res['per_device_batch']} examples per device")
    ax2.set(xlabel="devices", ylabel="examples / s", xticks=counts,
            title="throughput (virtual CPUs, shared cores)")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def final_loss(batch_size: int, lr: float, epochs: int = 2, n: int = 1024,
               sizes: Sequence[int] = (8, 16, 1), device: str = "/device:CPU:0") -> float:
    """Full-data mean squared error after ``epochs`` of plain SGD with ``batch_size`` and ``lr``
    on ``data.regression(n)`` (same data, same initial weights for every call)."""
    checks.positive_int("n", n)
    if checks.positive_int("batch_size", batch_size) > n:
        raise ValueError(f"batch_size {batch_size} is larger than the data set (n={n}): "
                         "not one step would run")
    x, y, _ = data.regression(n, sizes[0], sizes[-1], seed=0)
    step = make_single_step(models.mlp_apply, squared_error, models.mlp_init(list(sizes)),
                            lr, device)
    for _ in range(epochs):
        for i in range(0, n - batch_size + 1, batch_size):
            step(x[i:i + batch_size], y[i:i + batch_size])
    pred = models.mlp_apply(step.variables, x)
    return float(tf.reduce_mean(squared_error(y, pred)))


def check_update_scale(answer) -> str:
    """Exercise 1: 3 replicas, global batch 96, SGD at 0.05; each replica divides its summed
    per-example losses by its own 32 examples. The learning rate plain SGD effectively uses."""
    if answer is None:
        return "not yet: set answer1 to a learning rate"
    right = 0.05 * 96 / 32
    if isinstance(answer, (int, float)) and abs(answer - right) < 1e-9:
        return "right: the replicas' gradients are summed, each 96 / 32 = 3 times too large"
    return f"not quite: {answer!r} (the strategy sums the replicas' gradients)"


def check_compute_for_80(answer) -> str:
    """Exercise 2: the per-GPU compute time (ms) below which the cost model gives 8 GPUs on a
    10 GB/s ring less than 80% efficiency for 102.4 MB of gradients (within 2 ms)."""
    if answer is None:
        return "not yet: set answer2 to a compute time in ms"
    grid = np.arange(1, 501) * 1e-3
    eff = [c / data_parallel_step_time(8, c, 25.6e6 * 4, 10e9) for c in grid]
    right = 1e3 * float(grid[int(np.argmax(np.array(eff) >= 0.8))])
    if isinstance(answer, (int, float)) and abs(answer - right) <= 2:
        return f"right: about {right:.0f} ms (exchange time x 4: 80% means compute = 4 x exchange)"
    return f"not quite: at {answer!r} ms the model is {'above' if answer > right else 'below'} 80%"


def check_parallel_calls(answer) -> str:
    """Exercise 3: a step computes in 30 ms, the map takes 80 ms per batch; with prefetch and
    ``num_parallel_calls=k`` a batch is ready every 80 / k ms. The smallest k making the step
    compute-bound."""
    if answer is None:
        return "not yet: set answer3 to a number of parallel calls"
    right = next(k for k in range(1, 100) if 80 / k <= 30)
    if answer == right:
        return f"right: {right} calls give a batch every {80 / right:.1f} ms <= 30 ms of compute"
    if not isinstance(answer, int) or answer < 1:
        return f"not quite: give a whole number >= 1, got {answer!r}"
    return f"not quite: with {answer} calls a batch is ready every {80 / answer:.1f} ms"
