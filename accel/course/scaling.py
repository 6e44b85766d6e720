"""Chapter 07's experiments: how data parallelism scales, measured (towers vs MirroredStrategy vs
one device), and the batch-size side (the linear scaling rule tried on a toy problem).

* ``timed_steps(n, ...)``: the three training steps for ``n`` devices, ready to time;
* ``measure_scaling(counts)``: step time and examples/s for 1, 2, 4 devices, by hand and with
  MirroredStrategy, measured in one run (interleaved, medians);
* ``format_scaling(results)``: that as a table of step times and ratios;
* ``bench_towers()``: the ``python -m accel bench towers`` report (ratios for 2 and 4 devices);
* ``keras_cnn()``, ``keras_timed_steps(n, ...)`` and ``bench_keras_towers()``: the same race on
  a Keras CNN, ``DataParallel.train_step`` vs Keras's own train step under
  ``MirroredStrategy`` (``Mirrored``) vs Keras on one device (``python -m accel bench
  keras-towers``);
* ``figure_scaling(results)``: the plot of ``measure_scaling`` (chapter 07 shows the overlap of
  the exchange instead: ``accel.course.overlap``);
* ``final_loss``: the loss a batch size and learning rate reach (the linear scaling rule tried);
* ``check_uneven_mirrored``, ``check_scaling_limit``, ``check_adam_mistake``: the exercises.

The cost model of a step on real accelerators is ``accel.costmodel.steps``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from accel import checks, datasets, devices, models, timing
from accel.parallel.data import (
    DataParallel,
    make_single_step,
    make_tower_step,
    scaled_learning_rate,
    split_batch,
)
from accel.parallel.mirrored import Mirrored, make_mirrored_step, mirrored_strategy
from accel.training import squared_error

__all__ = ["BENCH_SIZES", "timed_steps", "measure_scaling", "format_scaling", "bench_towers",
           "KERAS_CNN", "keras_cnn", "keras_timed_steps", "bench_keras_towers",
           "figure_scaling", "final_loss", "UNEVEN_SHARDS", "check_uneven_mirrored",
           "SCALING_BATCHES", "check_scaling_limit", "check_adam_mistake"]

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
    x, y, _ = datasets.regression(global_batch, sizes[0], sizes[-1], seed=n)
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
    times = timing.interleaved_medians(steps, rounds, repeat)
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
    per_device_batch = 16 if quick else per_device_batch
    res = measure_scaling(device_names, counts, per_device_batch,
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
    measured = timing.measure_ceiling()
    out["ceiling"] = measured.value
    lines.append(timing.ceiling_line(measured) + "; virtual CPUs share these cores")
    print("\n".join(lines))
    return out


KERAS_CNN = {"image": 32, "channels": 3, "filters": (16, 32), "dense": 64, "classes": 10}
_QUICK_CNN = {"image": 8, "channels": 1, "filters": (4,), "dense": 8, "classes": 4}


def keras_cnn(image: int = 32, channels: int = 3, filters: Sequence[int] = (16, 32),
              dense: int = 64, classes: int = 10, seed: int = 0):
    """A float32 Keras ``Sequential`` CNN: for each entry of ``filters`` a 3x3 ``Conv2D`` (ReLU)
    and a 2x2 ``MaxPooling2D``, then ``Flatten``, ``Dense(dense)`` (ReLU) and ``Dense(classes)``
    logits, on ``image`` x ``image`` x ``channels`` inputs (weights from ``seed``)."""
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((image, image, channels))]
    for f in filters:
        layers += [keras.layers.Conv2D(f, 3, activation="relu"), keras.layers.MaxPooling2D()]
    layers += [keras.layers.Flatten(), keras.layers.Dense(dense, activation="relu"),
               keras.layers.Dense(classes)]
    return keras.Sequential(layers)


def keras_timed_steps(n: int, device_names: Sequence[str], per_device_batch: int = 32,
                      cnn: dict | None = None, learning_rate: float = 1e-3
                      ) -> tuple[dict[str, Callable[[], float]], dict[str, Callable[[], list]]]:
    """Three ways to train the same Keras CNN (``keras_cnn(**cnn)``, default ``KERAS_CNN``) with
    SGD (momentum 0.9) on the same global batch of ``n * per_device_batch`` images, every set-up
    done here, none left for the timed calls:

    * ``single``: Keras's own train step (``model.train_function``, what ``fit`` calls once a
      batch) on ``device_names[0]``, reading the batch from an iterator over a repeated
      ``tf.data`` dataset that holds it;
    * ``towers``: ``DataParallel(model, device_names[:n], ...).train_step(x, y)``, the batch
      given as tensors on the first device (the step splits it);
    * ``mirrored``: Keras's own train step under ``MirroredStrategy`` over the same devices
      (``Mirrored``), reading the batch from the same dataset distributed by the strategy (each
      replica's shard prefetched to its device, as ``fit`` does).

    Returns ``(steps, weights)``: zero-argument callables running one step and returning the loss
    as a float (Keras's train steps report the running mean of the epoch's losses), and
    zero-argument callables returning each contender's current weights. All start from the
    same weights, so after the same number of steps the weights agree (float32 round-off)."""
    import keras

    if n < 1 or n > len(device_names):
        raise ValueError(f"n must be in 1..{len(device_names)} (the devices given), got {n}")
    cnn = dict(KERAS_CNN if cnn is None else cnn)
    devs = list(device_names[:n])
    model = keras_cnn(**cnn)
    batch = n * checks.positive_int("per_device_batch", per_device_batch)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((batch, cnn["image"], cnn["image"], cnn["channels"]),
                            dtype=np.float32)
    y = rng.integers(0, cnn["classes"], batch).astype(np.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def sgd():
        return keras.optimizers.SGD(learning_rate, momentum=0.9)

    def build():
        copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
        copy.compile(optimizer=sgd(), loss=loss, jit_compile=False)
        copy.make_train_function()
        return copy

    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    with tf.device(devs[0]):
        single = build()
        xt, yt = tf.constant(x), tf.constant(y)
    single_batches = iter(dataset)
    towers = DataParallel(model, devs, loss=loss, optimizer=sgd())
    mirrored = Mirrored(build, devs)
    mirrored_batches = iter(mirrored.strategy.experimental_distribute_dataset(dataset))
    steps = {"single": lambda: float(single.train_function(single_batches)["loss"]),
             "towers": lambda: towers.train_step(xt, yt),
             "mirrored": lambda: float(mirrored.model.train_function(mirrored_batches)["loss"])}
    weights = {"single": single.get_weights, "towers": towers.copy.get_weights,
               "mirrored": mirrored.model.get_weights}
    return steps, weights


def _weights_gap(a: list, b: list) -> float:
    """The largest difference between two weight lists, over the largest weight of ``a``."""
    top = max(float(np.max(np.abs(w))) for w in a)
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b, strict=True)) / top


def bench_keras_towers(device_names: Sequence[str], quick: bool = False,
                       counts: Sequence[int] = (2, 4), per_device_batch: int = 32) -> dict:
    """``python -m accel bench keras-towers``: the step time of ``DataParallel`` (towers) on a
    Keras CNN vs Keras's own train step under ``MirroredStrategy`` vs Keras on one device, same
    global batch, for 2 and 4 devices (goal: towers within 1.1x of MirroredStrategy).

    Every contender is built first (outside any timer), gets the same ``warmup`` untimed steps
    (the first one traces), then all are timed in interleaved rounds of ``repeat`` steps
    (``timing.time_fn``; the median of the rounds' medians). Prints the table, the largest gap
    between a contender's weights and the one-device model's after the same steps (a check that
    each did the same training), the goal and this machine's ceiling; returns
    ``{"<variant>_<n>": seconds, "towers/mirrored_<n>", "towers/single_<n>",
    "mirrored/single_<n>": ratios, "weight_gap_<n>": that gap over the largest weight,
    "ceiling", "warmup", "rounds", "repeat"}``."""
    counts = (2,) if quick else tuple(counts)
    per_device_batch = 4 if quick else per_device_batch
    warmup, rounds, repeat = (2, 1, 1) if quick else (3, 8, 3)
    cnn = _QUICK_CNN if quick else KERAS_CNN
    built = {n: keras_timed_steps(n, device_names, per_device_batch, cnn) for n in counts}
    times = timing.interleaved_medians({(v, n): fn for n, (steps, _) in built.items()
                           for v, fn in steps.items()}, rounds, repeat, warmup)
    out: dict[str, float] = {"warmup": warmup, "rounds": rounds, "repeat": repeat}
    lines = [f"Keras CNN {cnn}, SGD momentum 0.9; global batch = n x {per_device_batch}; median "
             f"step time after {warmup} untimed steps each, {rounds} interleaved rounds of "
             f"{repeat}",
             f"{'devices':>7}  {'single':>9}  {'towers':>9}  {'mirrored':>9}  "
             f"{'towers/mirrored':>15}  {'towers/single':>13}  {'mirrored/single':>15}  "
             f"{'weight gap':>10}"]
    for n in counts:
        t = {v: times[(v, n)] for v in VARIANTS}
        out.update({f"{v}_{n}": t[v] for v in VARIANTS})
        for a, b in (("towers", "mirrored"), ("towers", "single"), ("mirrored", "single")):
            out[f"{a}/{b}_{n}"] = t[a] / t[b]
        w = {v: fn() for v, fn in built[n][1].items()}
        out[f"weight_gap_{n}"] = max(_weights_gap(w["single"], w[v]) for v in w)
        lines.append(f"{n:>7}  {t['single'] * 1e3:>7.1f}ms  {t['towers'] * 1e3:>7.1f}ms  "
                     f"{t['mirrored'] * 1e3:>7.1f}ms  {out[f'towers/mirrored_{n}']:>15.2f}  "
                     f"{out[f'towers/single_{n}']:>13.2f}  {out[f'mirrored/single_{n}']:>15.2f}"
                     f"  {out[f'weight_gap_{n}']:>10.1e}")
    worst = max(out[f"towers/mirrored_{n}"] for n in counts)
    lines.append(f"goal: towers within 1.1x of MirroredStrategy -> worst ratio {worst:.2f} "
                 f"({'met' if worst <= 1.1 else 'NOT met'}); weight gap: largest weight "
                 "difference to the one-device model after the same steps, over its largest "
                 "weight")
    measured = timing.measure_ceiling()
    out["ceiling"] = measured.value
    lines.append(timing.ceiling_line(measured) + "; virtual CPUs share these cores")
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
    on ``datasets.regression(n)`` (same data, same initial weights for every call)."""
    checks.positive_int("n", n)
    if checks.positive_int("batch_size", batch_size) > n:
        raise ValueError(f"batch_size {batch_size} is larger than the data set (n={n}): "
                         "not one step would run")
    x, y, _ = datasets.regression(n, sizes[0], sizes[-1], seed=0)
    step = make_single_step(models.mlp_apply, squared_error, models.mlp_init(list(sizes)),
                            lr, device)
    for _ in range(epochs):
        for i in range(0, n - batch_size + 1, batch_size):
            step(x[i:i + batch_size], y[i:i + batch_size])
    pred = models.mlp_apply(step.variables, x)
    return float(tf.reduce_mean(squared_error(y, pred)))


UNEVEN_SHARDS = [3, 3, 3, 1]  # exercise 1: how MirroredStrategy split a batch of 10 on 4 replicas


def check_uneven_mirrored(answer) -> str:
    """Exercise 1: ``(shard sizes, same)``: the per-replica sizes ``MirroredStrategy`` (4 replicas)
    gives a batch of 10 from ``experimental_distribute_dataset``, and whether the custom-loop
    step (``compute_average_loss`` with the global batch 10) ends with one device's weights
    (``True``). tests/course/test_scaling.py runs the fact."""
    if answer is None or answer is ...:
        return "exercise 1: not answered yet (set answer1 to (shard sizes, same weights?))"
    try:
        sizes, same = answer
        sizes = [int(v) for v in sizes]
    except (TypeError, ValueError):
        return f"exercise 1: answer1 should be (a list of 4 sizes, True or False), got {answer!r}"
    if sorted(sizes) != sorted(UNEVEN_SHARDS):
        return ("exercise 1: not quite: print the sizes the strategy gave each replica "
                "(strategy.experimental_local_results(batch[0]))")
    if same is not True:
        return ("exercise 1: not quite: compare the weights after a few steps. Each replica "
                "divides its *sum* of per-example losses by the global batch: what does the sum "
                "over the replicas give, whatever the shard sizes?")
    return ("exercise 1: correct: unequal shards (3, 3, 3, 1), yet one device's weights: each "
            "replica's sum over its examples / 10, summed over the replicas, is the mean over all "
            "10, so every example counts once. Section 2's mistake was averaging the shard "
            "*means*")


SCALING_BATCHES = (64, 128, 256, 512, 1024)


def check_scaling_limit(answer, base_batch: int = 32, base_lr: float = 0.01) -> str:
    """Exercise 2: the largest global batch of ``SCALING_BATCHES`` at which the linear scaling
    rule (learning rate ``base_lr * batch / base_batch``) still reaches ``final_loss`` of
    ``base_batch`` within 5 %. Runs ``final_loss`` for each (about a second)."""
    if answer is None or answer is ...:
        return "exercise 2: not answered yet (set answer2 to a batch size)"
    if answer not in SCALING_BATCHES:
        return f"exercise 2: answer2 should be one of {SCALING_BATCHES}, got {answer!r}"
    base = final_loss(base_batch, base_lr)
    ratios = {b: final_loss(b, scaled_learning_rate(base_lr, base_batch, b)) / base
              for b in SCALING_BATCHES}
    right = max(b for b in SCALING_BATCHES if all(abs(ratios[c] - 1) <= 0.05
                                                  for c in SCALING_BATCHES if c <= b))
    table = ", ".join(f"{b}: {r:.2f}x" for b, r in ratios.items())
    if answer == right:
        return f"exercise 2: correct: {right} (final loss / batch {base_batch}'s: {table})"
    return f"exercise 2: not quite (final loss / batch {base_batch}'s: {table})"


def check_adam_mistake(answer) -> str:
    """Exercise 3: does the per-replica-mean mistake (``global_batch_size`` of one replica's
    shard, 4 replicas) change Adam's weights after 8 steps by more than 1e-3? (``False``:
    Adam's step ``m / (sqrt(v) + eps)`` does not change when every gradient is 4 times larger,
    apart from ``eps``.) tests/course/test_scaling.py runs the fact."""
    if answer is None or answer is ...:
        return "exercise 3: not answered yet (set answer3 to True or False)"
    if not isinstance(answer, bool):
        return f"exercise 3: answer3 should be True or False, got {answer!r}"
    if answer:
        return ("exercise 3: not quite: run both and print models.max_difference. Adam divides "
                "the running mean of the gradients by the root of the running mean of their "
                "squares: what happens to that ratio when every gradient is 4 times larger?")
    return ("exercise 3: correct: Adam's step m / (sqrt(v) + eps) is the same for 4x the "
            "gradients (apart from eps = 1e-7), so the mistake is invisible with Adam and comes "
            "back as a 4x learning rate when you switch to SGD")
