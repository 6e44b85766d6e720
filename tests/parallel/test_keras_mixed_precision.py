"""Mixed precision in every Keras form: under ``mixed_bfloat16`` and ``mixed_float16`` (with
Keras's ``LossScaleOptimizer``) each form's update is within the spread of two legitimate Keras
runs of ``model.fit``'s on one device; a sharded form's devices skip overflowing steps and grow
the loss scale as ``fit`` does, step for step, from one finiteness verdict over their slices."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel.parallel.accumulate import Accumulating
from accel.parallel.data import DataParallel
from accel.parallel.model import ModelParallel
from accel.parallel.offload import Offload
from accel.parallel.pipeline_exec import Pipeline
from accel.parallel.replicas import KerasReplicas
from accel.parallel.tensor import TensorParallel
from accel.parallel.zero import Zero

BATCH, STEPS = 16, 3
SLOW = pytest.mark.slow


pytestmark = pytest.mark.usefixtures("float64_keras")  # restores floatx and the policy after


def _mixed_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,))] + [
        keras.layers.Dense(n, activation=a, kernel_regularizer=keras.regularizers.L2(0.01),
                           name=f"mixed{i}")
        for i, (n, a) in enumerate([(16, "relu"), (12, "tanh"), (8, "relu"), (3, None)])]
        + [keras.layers.Activation("linear", dtype="float32")])  # float32 outputs, as advised


def _mixed_optimizer(policy):
    # SGD with momentum, not Adam: Adam moves every element by about its learning rate
    # whatever the gradient's size, so an element whose gradient is rounding noise moves as
    # far as any other and the largest difference measures that noise, not the form
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.LossScaleOptimizer(sgd) if policy == "mixed_float16" else sgd


def _keras_mixed(policy, x, y, xla):
    model = _mixed_model()
    model.compile(optimizer=_mixed_optimizer(policy), loss="mse", jit_compile=xla)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model.get_weights()


MIXED_FORMS = ("towers", "split", "hybrid", "1f1b", "1f1b-recompute", "zero1", "zero3",
               "offload", "accumulate", "tensor")


@pytest.fixture(scope="module")
def mixed_references():
    """Per policy: Keras fit in graph mode (the reference), its distance to Keras fit compiled
    by XLA (the spread of two legitimate Keras runs: other kernels and fusions, other
    rounding), and the update's size; all relative to the largest weight change."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH * STEPS, 6)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, 3)).astype("float32")
    found = {}
    before = keras.config.dtype_policy().name
    assert keras.config.floatx() == "float32"
    try:
        for policy in ("mixed_bfloat16", "mixed_float16"):
            keras.config.set_dtype_policy(policy)
            ref, xla = _keras_mixed(policy, x, y, False), _keras_mixed(policy, x, y, True)
            init = _mixed_model().get_weights()
            update = max(np.abs(a - b).max() for a, b in zip(ref, init, strict=True))
            spread = max(np.abs(a - b).max() for a, b in zip(ref, xla, strict=True)) / update
            found[policy] = (ref, update, spread)
    finally:
        keras.config.set_dtype_policy(before)
    return x, y, found


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("form", [pytest.param(f, marks=() if f == "towers" else SLOW)
                                  for f in MIXED_FORMS])
def test_mixed_policies_as_keras_fit(four_devices, mixed_references, policy, form):
    """Under the same policy (and a LossScaleOptimizer for float16, which fit scales the loss
    for), each form's update is within max(3 x the spread of two Keras runs, 5e-2) of fit's,
    relative to the update's size, and the loss falls."""
    x, y, found = mixed_references
    ref, update, spread = found[policy]
    d = four_devices
    make_form = {
        "towers": lambda m, o: DataParallel(m, d[:2], loss="mse", optimizer=o),
        "split": lambda m, o: ModelParallel(m, d[:2], loss="mse", optimizer=o),
        "hybrid": lambda m, o: ModelParallel(m, replicas=[d[:2], d[2:4]], loss="mse",
                                             optimizer=o),
        "1f1b": lambda m, o: Pipeline(m, d[:2], loss="mse", optimizer=o, num_microbatches=4),
        "1f1b-recompute": lambda m, o: Pipeline(m, d[:2], loss="mse", optimizer=o,
                                                num_microbatches=4, recompute=True),
        "zero1": lambda m, o: Zero(m, d[:2], loss="mse", optimizer=o, stage=1),
        "zero3": lambda m, o: Zero(m, d[:2], loss="mse", optimizer=o, stage=3),
        "offload": lambda m, o: Offload(m, d[:2], host=d[2], loss="mse", optimizer=o),
        "accumulate": lambda m, o: Accumulating(m, loss="mse", optimizer=o,
                                                accumulation_steps=2),
        "tensor": lambda m, o: TensorParallel(m, d[:2], {"mixed[02]$": "column", "mixed1$": "row"},
                                              loss="mse", optimizer=o),
    }[form]
    keras.config.set_floatx("float32")  # this file's fixture restores both afterwards
    keras.config.set_dtype_policy(policy)
    model = _mixed_model()
    trainer = make_form(model, _mixed_optimizer(policy))
    losses = []
    for k in range(STEPS):
        loss = trainer.train_step(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
        losses.append(loss["loss"])
    trainer.write_back()
    again = trainer.train_step(x[:BATCH], y[:BATCH])
    assert again["loss"] < losses[0]  # the first batch, trained on
    diff = max(np.abs(np.asarray(a, np.float64) - b).max()
               for a, b in zip(model.get_weights(), ref, strict=True)) / update
    print(f"{form} {policy}: update within {diff:.3f} of fit's; Keras's spread {spread:.3f}")
    assert diff <= max(3 * spread, 5e-2), (diff, spread)


@pytest.mark.parametrize("form", ["zero2", pytest.param("offload", marks=SLOW)])
def test_sharded_loss_scaling_skips_and_grows_as_fit(four_devices, form):
    """float16 with a LossScaleOptimizer whose first scale overflows: Keras's fit skips those
    steps and halves the scale, then grows it after every 2 finite steps; a sharded form's
    devices do the same, step for step (the scale each device ends with is fit's), and the
    weights follow fit's (clipped by the global norm as fit clips them)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(BATCH * 6, 6)).astype("float32")
    y = rng.normal(size=(BATCH * 6, 3)).astype("float32")

    def optimizer():
        # global_clipnorm too: the form clips by the norm of the unscaled gradients, as Keras's
        # inner optimizer does after the wrapper has divided the scale out
        inner = keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.5)
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**20,
                                                   dynamic_growth_steps=2)

    keras.config.set_floatx("float32")  # this file's fixture restores both afterwards
    keras.config.set_dtype_policy("mixed_float16")
    ref = _mixed_model()
    ref.compile(optimizer=optimizer(), loss="mse")
    ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert 0 < int(ref.optimizer.iterations) < 6  # some steps skipped, some applied
    model = _mixed_model()
    d = four_devices
    trainer = (Zero(model, d[:2], loss="mse", optimizer=optimizer(), stage=2) if form == "zero2"
               else Offload(model, d[:2], host=d[2], loss="mse", optimizer=optimizer()))
    for k in range(6):
        trainer.train_step(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
    trainer.write_back()
    opts = trainer.optimizers if form == "zero2" else [trainer.optimizer]
    assert [float(o.dynamic_scale) for o in opts] == [float(ref.optimizer.dynamic_scale)] * len(
        opts)
    update = max(np.abs(a - b).max() for a, b in zip(ref.get_weights(),
                                                      _mixed_model().get_weights(), strict=True))
    diff = max(np.abs(np.asarray(a, np.float64) - b).max()
               for a, b in zip(model.get_weights(), ref.get_weights(), strict=True))
    assert diff <= 5e-2 * update, (diff, update)


def test_one_verdict_for_the_devices_slices(four_devices):
    """A device whose slice holds an infinity makes every device's gradients NaN (each
    LossScaleOptimizer then skips); all finite, the gradients are returned unchanged."""
    d = four_devices[:2]
    ok = [[tf.constant([1.0, 2.0])], [tf.constant([3.0])]]
    bad = [[tf.constant([1.0, 2.0])], [tf.constant([np.inf])]]
    same = KerasReplicas._one_verdict(ok, d, sliced=True)
    np.testing.assert_array_equal(same[0][0].numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(same[1][0].numpy(), [3.0])
    judged = KerasReplicas._one_verdict(bad, d, sliced=True)
    assert all(np.isnan(g.numpy()).all() for gs in judged for g in gs)
    alone = KerasReplicas._one_verdict(bad, d, sliced=False)  # each device its own whole
    np.testing.assert_array_equal(alone[0][0].numpy(), [1.0, 2.0])
