"""Functional Keras models in the forms that cut a model (issue: functional models in every form
that cuts a model): a residual CNN with BatchNormalization whose skip connection crosses a cut,
a text model with an embedding and a block holding a nested ``Sequential`` MLP, and a model
with two inputs and two outputs, through the split, the hybrid and the pipelines (GPipe, 1F1B,
interleaved), each against Keras's ``fit`` on one device (float64; BatchNorm per replica or
micro-batch = ``fit`` with ``gradient_accumulation_steps``, as the README says); what crosses
each cut against a hand count and the bytes the placed graph sends; refusals."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel.parallel import graph
from accel.parallel.model import ModelParallel
from accel.parallel.pipeline_exec import Pipeline
from accel.parallel.tensor import TensorParallel
from accel.parallel.trace import transfers_of

DT = "float64"
BATCH, STEPS = 16, 3
SLOW = pytest.mark.slow


pytestmark = pytest.mark.usefixtures("float64_keras")  # tests/parallel/conftest.py


@keras.saving.register_keras_serializable("accel_tests_functional")
class FeedForwardBlock(keras.layers.Layer):
    """Attention then an MLP kept as a nested ``Sequential`` (keras.io's ``self.ffn``)."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.attn = keras.layers.MultiHeadAttention(2, width // 2, dtype=self.dtype_policy)
        self.ffn = keras.Sequential([keras.layers.Dense(2 * width, activation="relu",
                                                        dtype=self.dtype_policy),
                                     keras.layers.Dense(width, dtype=self.dtype_policy)])

    def call(self, x):
        return self.ffn(self.attn(x, x))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def residual_cnn():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6, 6, 2), dtype=DT, name="image")
    x = keras.layers.Conv2D(4, 3, padding="same", dtype=DT, name="conv")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8, dtype=DT, name="bn1")(x)
    skip = keras.layers.Activation("relu", dtype=DT, name="relu")(x)
    x = keras.layers.SeparableConv2D(4, 3, padding="same", dtype=DT, name="sep")(skip)
    x = keras.layers.BatchNormalization(momentum=0.8, dtype=DT, name="bn2")(x)
    x = keras.layers.Add(dtype=DT, name="add")([x, skip])
    x = keras.layers.GlobalAveragePooling2D(dtype=DT, name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(3, dtype=DT, name="head")(x))


def text_model():
    keras.utils.set_random_seed(6)
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(12, 8, dtype=DT, name="embed")(tokens)
    h = FeedForwardBlock(8, dtype=DT, name="block")(x)
    h = keras.layers.Add(dtype=DT, name="residual")([x, h])
    h = keras.layers.LayerNormalization(dtype=DT, name="norm")(h)
    h = keras.layers.GlobalAveragePooling1D(dtype=DT, name="pool")(h)
    return keras.Model(tokens, keras.layers.Dense(3, dtype=DT, name="logits")(h))


def two_in_two_out():
    keras.utils.set_random_seed(7)
    a, b = keras.Input((4,), dtype=DT, name="a"), keras.Input((3,), dtype=DT, name="b")
    h = keras.layers.Dense(5, activation="tanh", dtype=DT, name="d1")(a)
    s = keras.layers.Concatenate(dtype=DT, name="cat")([h, b])
    o1 = keras.layers.Dense(2, dtype=DT, name="o1")(s)
    o2 = keras.layers.Add(dtype=DT, name="o2")([keras.layers.Dense(5, dtype=DT, name="d2")(s), h])
    return keras.Model([a, b], [o1, o2])


def data(name):
    rng = np.random.default_rng(8)
    n = BATCH * STEPS
    if name == "cnn":
        return rng.normal(size=(n, 6, 6, 2)), rng.normal(size=(n, 3))
    if name == "text":
        return rng.integers(0, 12, (n, 5)).astype("int32"), rng.integers(0, 3, n)
    if name == "mlp":
        return rng.normal(size=(n, 4)), rng.normal(size=(n, 2))
    return [rng.normal(size=(n, 4)), rng.normal(size=(n, 3))], [rng.normal(size=(n, 2)),
                                                                 rng.normal(size=(n, 5))]


def residual_mlp():
    """Megatron's MLP at the top level of a functional model, in a residual branch: up's
    output is read by down alone, so its column slices are handed over without a gather."""
    keras.utils.set_random_seed(9)
    inputs = keras.Input((4,), dtype=DT, name="x")
    h = keras.layers.Dense(8, activation="relu", dtype=DT, name="up")(inputs)
    h = keras.layers.Dense(4, dtype=DT, name="down")(h)
    h = keras.layers.Add(dtype=DT, name="add")([inputs, h])
    return keras.Model(inputs, keras.layers.Dense(2, dtype=DT, name="head")(h))


MODELS = {"cnn": residual_cnn, "text": text_model, "two": two_in_two_out, "mlp": residual_mlp}


def loss_of(name):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True) if name == "text" \
        else "mse"


def optimizer_of(name, accumulation=None):
    if name == "cnn":  # SGD: fit's accumulation equals per-part BatchNorm (no bias correction)
        return keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=accumulation)
    return keras.optimizers.Adam(0.02)


def keras_fit(name, parts=1):
    """Keras on one device: with BatchNorm, on batches of B / parts with
    gradient_accumulation_steps=parts (what per-part statistics equal)."""
    model = MODELS[name]()
    x, y = data(name)
    acc = parts if name == "cnn" and parts > 1 else None
    model.compile(optimizer=optimizer_of(name, acc), loss=loss_of(name), run_eagerly=True)
    batch = BATCH // parts if acc else BATCH
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model.get_weights()


def rows(v, k):
    return tf.nest.map_structure(lambda a: a[k * BATCH:(k + 1) * BATCH], v)


def train(form, name):
    x, y = data(name)
    for k in range(STEPS):
        form.train_step(rows(x, k), rows(y, k))
    form.write_back()


SPLITS = {"cnn": ["sep", "add"], "text": ["block"], "two": ["cat"]}


def make(form, name, devices):
    model = MODELS[name]()
    kw = {"loss": loss_of(name), "optimizer": optimizer_of(name)}
    points = SPLITS[name]
    if form == "split":
        return model, ModelParallel(model, devices[:len(points) + 1], split_points=points, **kw), 1
    if form == "hybrid":
        return model, ModelParallel(model, replicas=[devices[:2], devices[2:4]],
                                    split_points=points[:1], **kw), 2
    if form == "interleaved":
        every = [c.name for c in graph.model_graph(model).calls][1:4]
        return model, Pipeline(model, devices[:2], schedule="interleaved", num_chunks=2,
                               num_microbatches=2, split_points=every, **kw), 2
    recompute = form.endswith("-recompute")  # the forward run again inside the backward's call
    return model, Pipeline(model, devices[:len(points) + 1], schedule=form.split("-")[0],
                           num_microbatches=4, split_points=points, recompute=recompute, **kw), 4


# the split on every model; the hybrid, each schedule on the models whose crossings test them
CASES = ([("split", m) for m in ("cnn", "text", "two")]
         + [("hybrid", "cnn"), ("hybrid", "two"), ("hybrid", "text"), ("gpipe", "two"),
            ("1f1b", "cnn"), ("1f1b", "text"), ("interleaved", "cnn"), ("interleaved", "two"),
            ("1f1b-recompute", "two")])  # its text model: test_keras_losses
QUICK = {("split", "cnn"), ("1f1b", "cnn"), ("gpipe", "two"), ("hybrid", "text"),
         ("1f1b-recompute", "two")}


@pytest.mark.parametrize("form,name", [pytest.param(f, m, marks=() if (f, m) in QUICK else SLOW)
                                       for f, m in CASES])
def test_functional_models_equal_keras_fit(four_devices, form, name):
    model, trainer, parts = make(form, name, four_devices)
    train(trainer, name)
    ref = keras_fit(name, parts)
    got = model.get_weights()
    stats = [i for i, w in enumerate(model.weights) if "moving" in w.path]
    if form == "hybrid":  # replica 0's statistics are written back (checked elsewhere)
        got = [w for i, w in enumerate(got) if i not in stats]
        ref = [w for i, w in enumerate(ref) if i not in stats]
    scale = max(np.abs(w).max() for w in ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale,
                                   err_msg=f"{form} on {name}: weight {i}")


TP_RULES = {  # heads and Megatron's MLP inside the block's nested Sequential; top-level
    "text": {"block/attn$": "heads", "block/ffn/0$": "column", "block/ffn/1$": "row"},
    "two": {"^o1$": "column"},  # a model output: gathered
    "mlp": {"^up$": "column", "^down$": "row"},  # up's one reader is down: handed over
}


@pytest.mark.parametrize("name", list(TP_RULES))
def test_tensor_parallel_on_functional_models_equals_keras_fit(four_devices, name):
    model = MODELS[name]()
    tp = TensorParallel(model, four_devices[:2], TP_RULES[name], loss=loss_of(name),
                        optimizer=optimizer_of(name))
    assert isinstance(tp.model, keras.Model) and not isinstance(tp.model, keras.Sequential)
    assert tp.handoffs == {"text": [("block/ffn/0", "block/ffn/1")], "two": [],
                           "mlp": [("up", "down")]}[name]
    x, _ = data(name)
    for a, b in zip(tf.nest.flatten(tp.model.predict(rows(x, 0), verbose=0)),
                    tf.nest.flatten(model.predict(rows(x, 0), verbose=0)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    train(tp, name)
    ref = keras_fit(name)
    scale = max(np.abs(w).max() for w in ref)
    for i, (a, b) in enumerate(zip(model.get_weights(), ref, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale,
                                   err_msg=f"tensor on {name}: weight {i}")


def test_a_skip_connection_passes_through_the_part_it_skips(four_devices):
    """The residual CNN cut before "sep" and before "add": the middle part receives relu's
    output, uses it, and passes it on unchanged to the part with the Add."""
    g = graph.model_graph(residual_cnn())
    parts = graph.cut(g, graph.split_sizes(g, 3, ["sep", "add"]))
    assert [[c.name for c in p.calls] for p in parts] == [
        ["conv", "bn1", "relu"], ["sep", "bn2"], ["add", "pool", "head"]]
    assert parts[1].inputs == [("relu", 0)]
    assert parts[1].outputs == [("relu", 0), ("bn2", 0)]
    per_example = 6 * 6 * 4 * 8
    assert graph.crossings(g, parts) == [[("relu:0", (6, 6, 4), "float64", per_example)],
                                         [("relu:0", (6, 6, 4), "float64", per_example),
                                          ("bn2:0", (6, 6, 4), "float64", per_example)]]


def test_crossing_bytes_are_what_the_placed_graph_sends(four_devices):
    """Two inputs, two outputs, cut before "cat": input b (3 floats) and d1's output (5) cross
    to the second device, 64 bytes an example by hand, and TensorFlow's placed forward graph
    sends exactly that many from the first device to the second."""
    model = two_in_two_out()
    split = ModelParallel(model, four_devices[:2], loss="mse", optimizer="sgd",
                          split_points=["cat"])
    assert split.crossings() == [[("b:0", (3,), "float64", 24), ("d1:0", (5,), "float64", 40)]]
    (a, b), _ = data("two")

    @tf.function
    def forward(a, b):
        bundle = (a, b)
        for part, copies, device in zip(split.graph_parts, split.copies[0], four_devices[:2],
                                        strict=True):
            with tf.device(device):
                bundle, _ = graph.run_part(part, copies, bundle, training=False)
        with tf.device(four_devices[1]):  # one number back: the outputs stay where made
            return tf.add_n([tf.reduce_sum(t) for t in bundle])

    with tf.device(four_devices[0]):
        a, b = tf.constant(a[:BATCH]), tf.constant(b[:BATCH])
    sent = sum(t.nbytes for t in transfers_of(forward, a, b) if not t.control and t.shape
               and t.shape[0] == BATCH  # examples (the function's scalar result plumbing not)
               and t.source.endswith("CPU:0") and t.target.endswith("CPU:1"))
    assert sent == BATCH * (24 + 40)


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_refusals(four_devices):
    kw = {"loss": "mse", "optimizer": "sgd"}
    sub = _Subclassed()
    sub(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="subclassed model: .* functional model .*DataParallel"):
        ModelParallel(sub, four_devices[:2], **kw)
    with pytest.raises(ValueError, match="subclassed model: .* functional model"):
        TensorParallel(sub, four_devices[:2], {"dense": "column"}, **kw)
    shared = keras.layers.Dense(3, name="shared")
    x = keras.Input((3,))
    twice = keras.Model(x, shared(shared(x)))
    with pytest.raises(ValueError, match="layer 'shared' is called 2 times"):
        Pipeline(twice, four_devices[:2], num_microbatches=2, **kw)
    model = two_in_two_out()
    with pytest.raises(ValueError, match="split point 'nope' is not a layer"):
        ModelParallel(model, four_devices[:2], split_points=["nope"], **kw)
    with pytest.raises(ValueError, match="give 1 layer names"):
        ModelParallel(model, four_devices[:2], split_points=["cat", "d2"], **kw)
    with pytest.raises(ValueError, match="must be distinct layers after the first"):
        ModelParallel(model, four_devices[:2], split_points=["d1"], **kw)
