"""Every Keras form trains what ``model.fit`` trains (issue: every loss term, embeddings):
the compiled loss plus ``model.losses`` (kernel/bias/activity regularizers, ``add_loss``),
and an ``Embedding``'s sparse gradient, checked against Keras's own ``fit`` on one device
(float64, three steps, the same data and initial weights), never against the form itself.

The models are written here in the shape of keras.io examples: an MLP with L2 regularizers,
a text classifier (an ``Embedding``, a custom transformer block whose MLP is a nested
``Sequential``), a ``Sequential`` with a custom layer that calls ``add_loss`` (a VAE-style KL
term), and a subclassed VAE (``add_loss`` in ``call``), for the forms that take it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel.parallel.data import DataParallel
from accel.parallel.model import ModelParallel
from accel.parallel.pipeline_exec import Pipeline
from accel.parallel.zero import Zero

DT = "float64"
BATCH, STEPS = 16, 3
SLOW = pytest.mark.slow


pytestmark = pytest.mark.usefixtures("float64_keras")  # tests/parallel/conftest.py


@keras.saving.register_keras_serializable("accel_tests_losses")
class TextBlock(keras.layers.Layer):
    """Self-attention and an MLP kept as a nested ``Sequential`` (as keras.io's
    ``TransformerBlock`` keeps ``self.ffn``), post-norm residuals."""

    def __init__(self, width, heads, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.width, self.heads, self.dropout = width, heads, dropout
        policy = self.dtype_policy
        self.attn = keras.layers.MultiHeadAttention(heads, width // heads, dtype=policy)
        self.ffn = keras.Sequential([keras.layers.Dense(2 * width, activation="relu",
                                                        dtype=policy),
                                     keras.layers.Dropout(dropout, dtype=policy),
                                     keras.layers.Dense(width, dtype=policy)])
        self.norm1 = keras.layers.LayerNormalization(dtype=policy)
        self.norm2 = keras.layers.LayerNormalization(dtype=policy)

    def call(self, x, training=False):
        x = self.norm1(x + self.attn(x, x, training=training))
        return self.norm2(x + self.ffn(x, training=training))

    def get_config(self):
        return {**super().get_config(), "width": self.width, "heads": self.heads,
                "dropout": self.dropout}


@keras.saving.register_keras_serializable("accel_tests_losses")
class KLBottleneck(keras.layers.Layer):
    """A VAE's bottleneck without the noise (so runs compare exactly): the mean and log
    variance of a Gaussian, the KL term to N(0, 1) (mean over the batch) added with
    ``add_loss``, the mean passed on."""

    def __init__(self, units, weight=0.1, **kwargs):
        super().__init__(**kwargs)
        self.units, self.weight = units, weight
        self.mean = keras.layers.Dense(units, dtype=self.dtype_policy)
        self.log_var = keras.layers.Dense(units, dtype=self.dtype_policy)

    def call(self, x):
        mean, log_var = self.mean(x), self.log_var(x)
        kl = -0.5 * keras.ops.sum(1 + log_var - mean**2 - keras.ops.exp(log_var), axis=-1)
        self.add_loss(self.weight * keras.ops.mean(kl))
        return mean

    def get_config(self):
        return {**super().get_config(), "units": self.units, "weight": self.weight}


@keras.saving.register_keras_serializable("accel_tests_losses")
class VAE(keras.Model):
    """A subclassed VAE (the subclassing guide's shape): encoder, bottleneck, decoder; the KL
    term through ``add_loss`` inside ``call``."""

    def __init__(self, features=6, latent=3, **kwargs):
        super().__init__(**kwargs)
        self.features, self.latent = features, latent
        self.encoder = keras.layers.Dense(8, activation="relu", dtype=DT)
        self.bottleneck = KLBottleneck(latent, dtype=DT)
        self.decoder = keras.Sequential([keras.layers.Dense(8, activation="relu", dtype=DT),
                                         keras.layers.Dense(features, dtype=DT)])

    def call(self, x):
        return self.decoder(self.bottleneck(self.encoder(x)))

    def get_config(self):
        return {**super().get_config(), "features": self.features, "latent": self.latent}


def l2_mlp(regularized=True):
    kernel, bias = (keras.regularizers.L2(0.05), keras.regularizers.L2(0.01)) if regularized \
        else (None, None)
    return keras.Sequential([keras.Input((6,), dtype=DT)] + [
        keras.layers.Dense(n, activation=a, kernel_regularizer=kernel, bias_regularizer=bias,
                           dtype=DT)
        for n, a in [(16, "relu"), (12, "tanh"), (8, "relu"), (3, None)]])


def text(dropout=0.0):
    return keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(12, 8, dtype=DT),
        TextBlock(8, 2, dropout=dropout, dtype=DT),
        keras.layers.GlobalAveragePooling1D(dtype=DT),
        keras.layers.Dense(3, dtype=DT)])


def kl_seq():
    return keras.Sequential([
        keras.Input((6,), dtype=DT),
        keras.layers.Dense(8, activation="relu", dtype=DT),
        KLBottleneck(4, dtype=DT),
        keras.layers.Dense(8, activation="relu", dtype=DT),
        keras.layers.Dense(3, dtype=DT)])


def vae():
    model = VAE(dtype=DT)
    model(np.zeros((1, 6)))  # built by a call, as subclassed models are
    return model


MODELS = {"l2_mlp": l2_mlp, "text": text, "kl_seq": kl_seq, "vae": vae}


def text_loss():
    """Made when called: a Keras loss computes in the floatx of its making (float64 here)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def loss_of(name):
    return text_loss() if name == "text" else "mse"


def make(name, seed=0):
    keras.utils.set_random_seed(seed)
    model = MODELS[name]()
    rng = np.random.default_rng(seed + 1)
    n = BATCH * STEPS
    if name == "text":
        # a repeated token in a batch: Keras's sparse Adam squares each occurrence's row
        return model, rng.integers(0, 12, (n, 5)).astype("int32"), rng.integers(0, 3, n)
    x = rng.normal(size=(n, 6))
    return model, x, (x if name == "vae" else rng.normal(size=(n, 3)))


_REFS: dict = {}


def keras_reference(name):
    """Keras's own fit on one device: 3 steps in order, Adam (bias-corrected, sparse rows for
    the embedding), the loss and every term of model.losses."""
    if name not in _REFS:
        model, x, y = make(name)
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss=loss_of(name),
                      run_eagerly=True)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        _REFS[name] = [w.copy() for w in model.get_weights()]
    return _REFS[name]


def assert_weights_equal(got, ref, what):
    scale = max(np.abs(w).max() for w in ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale,
                                   err_msg=f"{what}: weight {i}")


def train(form, x, y):
    for k in range(STEPS):
        form.train_step(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
    form.write_back()


def forms(devices):
    d = devices
    return {
        "towers": lambda m, loss: DataParallel(m, d[:2], loss=loss,
                                               optimizer=keras.optimizers.Adam(0.02)),
        "split": lambda m, loss: ModelParallel(m, d[:2], loss=loss,
                                               optimizer=keras.optimizers.Adam(0.02)),
        "hybrid": lambda m, loss: ModelParallel(m, replicas=[d[:2], d[2:4]], loss=loss,
                                                optimizer=keras.optimizers.Adam(0.02)),
        "gpipe": lambda m, loss: Pipeline(m, d[:2], loss=loss, schedule="gpipe",
                                          optimizer=keras.optimizers.Adam(0.02),
                                          num_microbatches=4),
        "1f1b": lambda m, loss: Pipeline(m, d[:2], loss=loss, schedule="1f1b",
                                         optimizer=keras.optimizers.Adam(0.02),
                                         num_microbatches=4),
        # one stage, the last: every forward runs in its backward's call, and an embedding's
        # sparse sums are added outside it
        "1f1b-one-stage": lambda m, loss: Pipeline(m, d[:1], loss=loss, schedule="1f1b",
                                                   optimizer=keras.optimizers.Adam(0.02),
                                                   num_microbatches=4),
        "1f1b-recompute": lambda m, loss: Pipeline(m, d[:2], loss=loss, schedule="1f1b",
                                                   optimizer=keras.optimizers.Adam(0.02),
                                                   num_microbatches=4, recompute=True),
        "interleaved": lambda m, loss: Pipeline(m, d[:2], loss=loss, schedule="interleaved",
                                                num_chunks=2, num_microbatches=2,
                                                optimizer=keras.optimizers.Adam(0.02)),
        "zero3": lambda m, loss: Zero(m, d[:2], loss=loss, stage=3, run_eagerly=True,
                                      optimizer=keras.optimizers.Adam(0.02)),
    }


CUTTING = ("split", "hybrid", "gpipe", "1f1b", "interleaved")
# the forms that densify an embedding's gradient (ZeRO's flat slices): not model.fit's sparse
# Adam on the text model (README), so that pair is compared elsewhere
# every model through the towers and the split (cheap), the others on the models that carry
# their risk: hybrid (all-reduced and gathered sparse rows), each pipeline schedule (losses per
# micro-batch), ZeRO stage 3 (losses through its gathered op)
CASES = ([("towers", m) for m in MODELS] + [("split", m) for m in ("l2_mlp", "text", "kl_seq")]
         + [("hybrid", "text"), ("hybrid", "kl_seq"), ("gpipe", "kl_seq"), ("1f1b", "text"),
            ("1f1b", "l2_mlp"), ("interleaved", "l2_mlp"), ("interleaved", "kl_seq"),
            ("zero3", "l2_mlp"), ("zero3", "vae"), ("1f1b-one-stage", "text"),
            ("1f1b-recompute", "text"), ("1f1b-recompute", "l2_mlp"), ("1f1b-recompute", "kl_seq")])
QUICK = {("towers", "l2_mlp"), ("1f1b", "text"), ("split", "kl_seq"), ("towers", "vae"),
         ("1f1b-recompute", "l2_mlp")}


@pytest.mark.parametrize("form,name", [pytest.param(f, m, marks=() if (f, m) in QUICK
                                                    else SLOW) for f, m in CASES])
def test_every_loss_term_as_keras_fit(four_devices, form, name):
    ref = keras_reference(name)
    model, x, y = make(name)
    trainer = forms(four_devices)[form](model, loss_of(name))
    train(trainer, x, y)
    assert_weights_equal(model.get_weights(), ref, f"{form} on {name}")


def test_the_terms_change_the_answer(four_devices):
    """The comparison above can fail: without its regularizers the same model trains to other
    weights (the defect this file guards against trained that other answer)."""
    ref = keras_reference("l2_mlp")
    regularized, x, y = make("l2_mlp")
    model = l2_mlp(regularized=False)
    model.set_weights(regularized.get_weights())
    trainer = DataParallel(model, four_devices[:2], loss="mse",
                           optimizer=keras.optimizers.Adam(0.02))
    train(trainer, x, y)
    diff = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), ref, strict=True))
    assert diff > 1e-3


def test_saved_and_loaded_after_training(four_devices, tmp_path):
    """The user's model holds the weights: save, load (custom layers registered), predict."""
    model, x, y = make("text")
    train(Pipeline(model, four_devices[:2], loss=text_loss(), num_microbatches=2,
                   optimizer=keras.optimizers.Adam(0.02)), x, y)
    model.save(tmp_path / "text.keras")
    back = keras.models.load_model(tmp_path / "text.keras")
    np.testing.assert_array_equal(back.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0))


@SLOW
def test_dropout_on_trains_and_stays_finite(four_devices):
    """With dropout on, no run equals another: each form trains, stays finite and lowers the
    loss on a repeated batch."""
    keras.utils.set_random_seed(3)
    model = text(dropout=0.2)
    rng = np.random.default_rng(4)
    x, y = rng.integers(0, 12, (BATCH, 5)).astype("int32"), rng.integers(0, 3, BATCH)
    first = float(text_loss()(y, model(x)))
    for make_form in (forms(four_devices)["towers"], forms(four_devices)["1f1b"]):
        trainer = make_form(model, text_loss())
        for _ in range(8):
            trainer.train_step(x, y)
        trainer.write_back()
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert float(text_loss()(y, model(x))) < first


def test_embedding_gradients_stay_sparse(four_devices):
    """The pipeline sums micro-batches' IndexedSlices as slices (it used to add them with +,
    a TypeError), and the towers keep every tower's rows."""
    from accel.parallel import keras_model as km

    g1 = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 2]),
                          tf.constant([3, 2]))
    g2 = tf.IndexedSlices(tf.constant([[5.0, 6.0]]), tf.constant([2]), tf.constant([3, 2]))
    both = km.merge_gradients([g1, g2], [0.5, 0.5])
    assert isinstance(both, tf.IndexedSlices)
    np.testing.assert_array_equal(both.indices.numpy(), [0, 2, 2])
    np.testing.assert_array_equal(tf.convert_to_tensor(both).numpy(),
                                  [[0.5, 1.0], [0.0, 0.0], [4.0, 5.0]])
    dense = km.merge_gradients([tf.ones((3, 2)), g2])  # a dense part: every row a slice
    np.testing.assert_array_equal(tf.convert_to_tensor(dense).numpy(),
                                  [[1, 1], [1, 1], [6, 7]])
    assert km.merge_gradients([None, None]) is None


# -- BatchNormalization: what each form's statistics equal (the README's table) ------------

def _bn_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((6,), dtype=DT),
                             keras.layers.Dense(8, dtype=DT),
                             keras.layers.BatchNormalization(momentum=0.8, dtype=DT),
                             keras.layers.Activation("relu", dtype=DT),
                             keras.layers.Dense(3, dtype=DT)])


def _residual_cnn():
    """A functional residual CNN (image_classification_from_scratch's shape, shrunk): separable
    convolutions, BatchNormalization, a skip connection added back."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6, 6, 2), dtype=DT)
    x = keras.layers.Conv2D(4, 3, padding="same", dtype=DT)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8, dtype=DT)(x)
    skip = keras.layers.Activation("relu", dtype=DT)(x)
    x = keras.layers.SeparableConv2D(4, 3, padding="same", dtype=DT)(skip)
    x = keras.layers.BatchNormalization(momentum=0.8, dtype=DT)(x)
    x = keras.layers.Add(dtype=DT)([x, skip])
    x = keras.layers.GlobalAveragePooling2D(dtype=DT)(x)
    return keras.Model(inputs, keras.layers.Dense(3, dtype=DT)(x))


@pytest.mark.parametrize("form,parts,net", [
    ("towers", 2, "mlp"), pytest.param("towers", 4, "mlp", marks=SLOW),
    ("towers", 2, "residual"), ("1f1b", 4, "mlp"), pytest.param("gpipe", 2, "mlp", marks=SLOW)])
def test_batchnorm_per_part_is_fit_with_accumulation(four_devices, form, parts, net):
    """Towers (n devices) and pipelines (m micro-batches) normalise each part of the batch by
    its own statistics and update the moving statistics part after part: equal to Keras's fit
    on batches of B / parts with ``gradient_accumulation_steps=parts`` (SGD, which has no
    step-count-dependent term; Adam's bias correction counts micro-steps there)."""
    build = _bn_model if net == "mlp" else _residual_cnn
    rng = np.random.default_rng(6)
    x = rng.normal(size=(BATCH * STEPS, *build().inputs[0].shape[1:]))
    y = rng.normal(size=(BATCH * STEPS, 3))
    ref = build()
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5,
                                               gradient_accumulation_steps=parts),
                loss="mse", run_eagerly=True)
    ref.fit(x, y, batch_size=BATCH // parts, shuffle=False, verbose=0)
    model = build()
    sgd = keras.optimizers.SGD(0.1, momentum=0.5)
    trainer = (DataParallel(model, four_devices[:parts], loss="mse", optimizer=sgd)
               if form == "towers" else
               Pipeline(model, four_devices[:2], loss="mse", optimizer=sgd, schedule=form,
                        num_microbatches=parts))
    train(trainer, x, y)
    assert_weights_equal(model.get_weights(), ref.get_weights(), f"{form} x {parts}")
    assert any("moving_mean" in w.path for w in model.weights)  # compared with the rest


def test_batchnorm_hybrid_and_zero_keep_the_first_replicas_statistics(four_devices):
    """Hybrid and ZeRO: each replica (device) normalises its own part; the moving statistics
    written back are replica 0's, i.e. those Keras's fit would keep training on replica 0's
    shards alone (same weights each step, so the statistics follow its shards only)."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(BATCH * STEPS, 6)), rng.normal(size=(BATCH * STEPS, 3))
    for make_form in (lambda m: ModelParallel(m, replicas=[four_devices[:2], four_devices[2:4]],
                                              loss="mse", optimizer=keras.optimizers.SGD(0.1)),
                      lambda m: Zero(m, four_devices[:2], loss="mse", stage=1,
                                     optimizer=keras.optimizers.SGD(0.1))):
        model = _bn_model()
        trainer = make_form(model)
        train(trainer, x, y)
        # replay: the weights each step had, and replica 0's shard through BatchNorm in training
        replay = _bn_model()
        sgd = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        replay.compile(optimizer=sgd, loss="mse", run_eagerly=True)
        replay.fit(x, y, batch_size=BATCH // 2, shuffle=False, verbose=0)
        # the trainable weights equal fit with accumulation (the mean of the two halves)
        assert_weights_equal([model.get_weights()[i] for i in (0, 1, 2, 3, 6, 7)],
                             [replay.get_weights()[i] for i in (0, 1, 2, 3, 6, 7)],
                             type(trainer).__name__)
        # the statistics: replica 0's shards only (first halves of each batch), same weights
        stats = _bn_model()
        weights = _bn_model().get_weights()
        bn = stats.layers[1]
        mean, var = np.zeros(8), np.ones(8)
        for k in range(STEPS):
            stats.set_weights(weights)
            h = stats.layers[0](x[k * BATCH:k * BATCH + BATCH // 2]).numpy()
            mean = 0.8 * mean + 0.2 * h.mean(axis=0)
            var = 0.8 * var + 0.2 * h.var(axis=0)
            replay_k = _bn_model()
            replay_k.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                             loss="mse", run_eagerly=True)
            replay_k.fit(x[:(k + 1) * BATCH], y[:(k + 1) * BATCH], batch_size=BATCH // 2,
                         shuffle=False, verbose=0)
            weights = replay_k.get_weights()
        assert bn.moving_mean.path.endswith("moving_mean")
        np.testing.assert_allclose(model.get_weights()[4], mean, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(model.get_weights()[5], var, rtol=1e-6, atol=1e-9)


# -- refusals that say what to do ---------------------------------------------------------

class _NoKwargs(keras.layers.Layer):
    def __init__(self, units):  # no **kwargs: Keras cannot pass name, dtype, trainable
        super().__init__()
        self.units = units
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class _NoConfig(keras.Model):
    """Made with an argument Keras cannot serialise and no get_config(): Keras's own error
    starts with a newline (its first line is empty)."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x) * self.scale


def test_refusals_say_what_to_do(four_devices):
    keras.config.set_floatx("float32")  # the fixture puts float64 back
    model = keras.Sequential([keras.Input((4,)), _NoKwargs(3), keras.layers.Dense(2)])
    for make_form in (lambda: DataParallel(model, four_devices[:2], loss="mse", optimizer="sgd"),
                      lambda: Pipeline(model, four_devices[:2], loss="mse", optimizer="sgd",
                                       num_microbatches=2)):
        with pytest.raises(ValueError, match=r"add \*\*kwargs to __init__"):
            make_form()
    subclassed = _NoConfig(np.ones(2, "float32"))
    subclassed(np.zeros((1, 4), "float32"))
    with pytest.raises(ValueError, match=r"does not implement get_config\(\)"):
        DataParallel(subclassed, four_devices[:2], loss="mse", optimizer="sgd")
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    towers = DataParallel(plain, four_devices[:2], loss="mse", optimizer="sgd")
    x, y = np.zeros((4, 4), "float32"), np.zeros((4, 2), "float32")
    for option in ("sample_weight", "class_weight"):
        with pytest.raises(ValueError, match=f"{option} is not supported"):
            towers.fit(x, y, batch_size=2, verbose=0, **{option: np.ones(4)})


def _dense_gradient_reference(name):
    """Keras's Adam on one device fed the *dense* gradient of the embedding (what the sharded
    forms' flat gradient buffers give it), with the same loss as fit."""
    model, x, y = make(name)
    adam = keras.optimizers.Adam(0.02)
    loss_fn = keras.losses.get(loss_of(name)) if name != "text" else text_loss()
    for k in range(STEPS):
        xb, yb = x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True))) + tf.add_n(
                [tf.cast(t, "float64") for t in model.losses] or [tf.zeros((), "float64")])
        grads = tape.gradient(loss, model.trainable_variables)
        adam.apply_gradients(zip([tf.convert_to_tensor(g) for g in grads],
                                 model.trainable_variables, strict=True))
    return model.get_weights()


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=SLOW)])
def test_sharded_forms_feed_keras_a_dense_embedding_gradient(four_devices, stage):
    """ZeRO (and Offload, Accumulating: the same flat buffers) densify an embedding's
    gradient: they equal Keras's Adam fed dense gradients, not fit's sparse Adam (a token seen
    twice in a batch: the square of the sum of its rows' gradients, not the sum of squares)."""
    dense = _dense_gradient_reference("text")
    model, x, y = make("text")
    train(Zero(model, four_devices[:2], loss=text_loss(), stage=stage, run_eagerly=True,
               optimizer=keras.optimizers.Adam(0.02)), x, y)
    assert_weights_equal(model.get_weights(), dense, f"zero {stage}")
    sparse = keras_reference("text")
    assert np.abs(sparse[0] - dense[0]).max() > 1e-4  # fit's sparse Adam differs
