"""Keras models the library did not build, and Keras training them on one device: the
references every Keras form is checked against (``keras_zoo``); and Keras' Adam on one device
beside the by-hand sharded steps (``steps_like_adam``); a mixture-of-experts layer's output and
gradients (``moe_run``)."""

import hashlib
import json
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.training import squared_error

RTOL = 1e-5
BATCH, STEPS = 16, 3


def assert_close(actual, ref, what="", scale=None):
    """rtol 1e-5; atol 1e-5 of ``scale`` (default: the largest reference value), so that
    weights whose true gradient is zero (attention's key bias) compare as rounding noise."""
    ref = np.asarray(ref, np.float64)
    scale = np.abs(ref).max() if scale is None else scale
    np.testing.assert_allclose(actual, ref, rtol=RTOL, atol=RTOL * max(scale, 1e-30),
                               err_msg=what)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), dtype="float64")] + [
        keras.layers.Dense(n, activation=a, dtype="float64")
        for n, a in [(16, "relu"), (16, "tanh"), (12, "relu"), (3, None)]])


@keras.saving.register_keras_serializable("accel_tests")
class Block(keras.layers.Layer):
    """A pre-norm transformer block as one layer, residuals inside."""

    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        self.width, self.heads = width, heads
        self.norm1 = keras.layers.LayerNormalization(dtype=self.dtype_policy)
        self.attn = keras.layers.MultiHeadAttention(heads, width // heads,
                                                    dtype=self.dtype_policy)
        self.norm2 = keras.layers.LayerNormalization(dtype=self.dtype_policy)
        self.up = keras.layers.Dense(2 * width, activation="gelu", dtype=self.dtype_policy)
        self.down = keras.layers.Dense(width, dtype=self.dtype_policy)

    def call(self, x, training=False):
        h = self.norm1(x)
        x = x + self.attn(h, h, training=training)
        return x + self.down(self.up(self.norm2(x)))

    def get_config(self):
        return {**super().get_config(), "width": self.width, "heads": self.heads}


def transformer(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5, 8), dtype="float64"),
        keras.layers.Dense(8, dtype="float64"),
        Block(8, 2, dtype="float64"),
        keras.layers.GlobalAveragePooling1D(dtype="float64"),
        keras.layers.Dense(3, dtype="float64")])


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 2), dtype="float64"),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", dtype="float64"),
        keras.layers.BatchNormalization(dtype="float64"),
        keras.layers.MaxPooling2D(dtype="float64"),
        keras.layers.Conv2D(4, 3, padding="same", activation="relu", dtype="float64"),
        keras.layers.Flatten(dtype="float64"),
        keras.layers.Dense(3, dtype="float64")])


MODELS = {"mlp": mlp, "transformer": transformer, "cnn": cnn}
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(0.01),
              "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)}


def data_for(model, n=BATCH * STEPS, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *model.inputs[0].shape[1:]))
    return x, rng.normal(size=(n, 3))


def clone(model):
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


_REFERENCES: dict = {}


def _digest(*arrays) -> str:
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.shape, a.dtype)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _unnamed(config) -> str:
    """A model's config without the names Keras generates (dense_7, block_3, ...)."""
    def strip(c):
        if isinstance(c, dict):
            return {k: strip(v) for k, v in c.items() if k not in ("name", "shared_object_id")}
        if isinstance(c, list):
            return [strip(v) for v in c]
        return c
    return json.dumps(strip(config), sort_keys=True, default=str)


def keras_fit(model, optimizer, x, y):
    """The reference: Keras's own fit on one device, in order, batch by batch. Kept per
    process for the same architecture, weights, optimizer configuration and data (tests of
    several forms compare with the same run; the returned model is only read)."""
    key = (_unnamed(model.get_config()), _digest(*model.get_weights(), x, y),
           type(optimizer).__name__,
           _unnamed(optimizer.get_config()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _keras_fit(model, optimizer, x, y)
    return _REFERENCES[key]


def _keras_fit(model, optimizer, x, y):
    ref = clone(model)
    # eager: tracing the transformer's train step costs more than the three steps it runs
    ref.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
    hist = ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return ref, hist.history["loss"][0]


def flat(tensors):
    """Tensors (or arrays) as one float64 vector."""
    return np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])


def first_gradients(model, x, y, microbatches=1):
    """d loss / d weights on one device for the first batch; with ``microbatches`` > 1, each
    micro-batch runs through the model on its own (its own BatchNorm statistics)."""
    ref = clone(model)
    loss_fn = keras.losses.MeanSquaredError()
    xb, yb = tf.constant(x[:BATCH]), tf.constant(y[:BATCH])
    with tf.GradientTape() as tape:
        parts = zip(tf.split(xb, microbatches), tf.split(yb, microbatches), strict=True)
        loss = tf.add_n([loss_fn(yk, ref(xk, training=True)) for xk, yk in parts]) / microbatches
    return float(loss), tape.gradient(loss, ref.trainable_weights)




@pytest.fixture
def float64_keras():
    """floatx float64 for a test, as a float64 user sets it: Keras computes the compiled loss
    in floatx (else fit itself fails adding a float32 loss to float64 regularizers). Both
    floatx and the global dtype policy (which a test may set) are put back as they were."""
    before = keras.config.floatx(), keras.config.dtype_policy().name
    keras.config.set_floatx("float64")
    yield
    keras.config.set_floatx(before[0])
    keras.config.set_dtype_policy(before[1])


@pytest.fixture(scope="session")
def keras_zoo():
    """The models (``mlp``, ``transformer``, ``cnn``: float64 ``Sequential`` s), optimizers by
    name, data, Keras's own one-device training and the comparison used by every Keras form."""
    return types.SimpleNamespace(
        RTOL=RTOL, BATCH=BATCH, STEPS=STEPS, assert_close=assert_close, MODELS=MODELS,
        OPTIMIZERS=OPTIMIZERS, data_for=data_for, clone=clone, keras_fit=keras_fit,
        first_gradients=first_gradients, flat=flat)


def _steps_like_adam(step, params, x, y, devices, steps, hyper, model_fn):
    vs = [tf.Variable(np.asarray(p, np.float64)) for p in params]
    opt = tf.keras.optimizers.Adam(**hyper)
    n = len(devices)
    xs = collectives.place(list(np.split(x, n)), devices)
    ys = collectives.place(list(np.split(y, n)), devices)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(y, model_fn(vs, x)))
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs, strict=False))
        got = float(sum(v.numpy() for v in step.step(xs, ys)))
        assert got == pytest.approx(float(loss), rel=1e-12)
    return vs, xs, ys


@pytest.fixture(scope="session")
def steps_like_adam():
    """``run(step, params, x, y, devices, steps, hyper, model_fn)``: ``steps`` steps of a by-hand
    ``step`` (``ZeroStep`` or ``OffloadStep`` whose ``devices`` each get a slice of the batch)
    beside Keras' Adam (``hyper``) on one device and the whole batch in float64, each step's
    loss equal to the reference's (rel 1e-12); returns the reference variables and the placed
    ``xs``, ``ys``."""
    return _steps_like_adam


def _expert_variables(gate, experts, devices):
    """The gate as a variable, and each expert's two weights as variables on its device
    (expert ``e`` on ``devices[e // (len(experts) / len(devices))]``, as the sharded layers
    want them)."""
    per = len(experts) // len(devices)
    es = []
    for e, (a, b) in enumerate(experts):
        with tf.device(devices[e // per]):
            es.append((tf.Variable(a), tf.Variable(b)))
    return tf.Variable(gate), es


def _outputs_and_gradients(fn, x, g, es):
    """``fn(xt, g, es) -> (y, extra)``; the output, extra and the gradients of sum(sin(y)) for
    the input, the gate and every expert weight."""
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        y, extra = fn(xt, g, es)
        loss = tf.reduce_sum(tf.sin(y))
    return y.numpy(), extra, tape.gradient(loss, [xt, g] + [w for e in es for w in e])


@pytest.fixture(scope="session")
def moe_run():
    """``variables(gate, experts, devices) -> (g, es)`` and ``run(fn, x, g, es) -> (y, extra,
    gradients)``: a mixture-of-experts layer's variables placed, and its output and gradients."""
    return types.SimpleNamespace(variables=_expert_variables, run=_outputs_and_gradients)
