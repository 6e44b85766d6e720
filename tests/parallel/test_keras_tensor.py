"""accel.parallel.tensor's Keras layers and TensorParallel: a Keras Sequential's Dense pairs
converted to column- / row-parallel layers train under Keras's own compile/fit exactly as the
original does on one device (weights after several steps, per step loss), every shard's
variables, optimizer slots, forward and backward matmuls on its own device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel import placement
from accel.parallel import tensor as tp
from accel.placement import short_device

RULES = {"^up": "column", "^down": "row"}
SLOW = pytest.mark.slow  # make test, not make quick


def mlp(seed=0):
    """Two Megatron pairs: up (column) then down (row), twice."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), dtype="float64")] + [
        keras.layers.Dense(n, activation=a, dtype="float64", name=name)
        for n, a, name in [(16, "relu", "up1"), (16, "tanh", "down1"), (12, "relu", "up2"),
                           (3, None, "down2")]])


def fit_equals_keras(z, par, model, optimizer, x, y, ref, ref_loss, **compile_kwargs):
    """``par.model`` trained by Keras's fit (one epoch, in order), written back into ``model``:
    the epoch loss and every weight equal Keras's ``ref`` on one device."""
    par.compile(optimizer, "mse", **compile_kwargs)
    history = par.model.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0)
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    par.write_back()
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i}", scale)


@pytest.mark.parametrize("n,opt", [(2, "adam"), pytest.param(2, "sgd_momentum", marks=SLOW),
                                   pytest.param(4, "adam", marks=SLOW), (4, "sgd_momentum")])
def test_tensor_parallel_fit_equals_keras_on_one_device(four_devices, keras_zoo, n, opt):
    z = keras_zoo
    model = mlp()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    par = tp.TensorParallel(model, four_devices[:n], RULES)
    assert [type(la).__name__ for la in par.layers] == ["ColumnParallelDense",
                                                       "RowParallelDense"] * 2
    assert [la.gather_output for la in par.layers[::2]] == [False, False]  # slices go straight on
    z.assert_close(par.model.predict(x, verbose=0), model.predict(x, verbose=0), "forward")
    fit_equals_keras(z, par, model, z.OPTIMIZERS[opt](), x, y, ref, ref_loss)
    # shard i's kernel and its optimizer slots on device i
    for layer in par.layers:
        for i, kernel in enumerate(layer.kernels):
            assert short_device(kernel.value.device) == four_devices[i]
    slots = {v.path: short_device(v.value.device) for v in par.model.optimizer.variables
             if v.path.endswith("_momentum")}
    # the last device: a kernel shard of each of the 4 layers, a bias shard of the 2 column ones
    assert sum(d == four_devices[n - 1] for d in slots.values()) == 4 + 2
    if opt == "adam":
        assert len(slots) == 4 * n + 2 * n + 2  # kernels, column biases, row biases


def test_each_shard_computes_forward_and_backward_on_its_device(four_devices):
    """In the placed graph of a training step: device i runs 3 MatMuls per split layer (the
    forward, the input gradient, the kernel gradient); the first layer's input gradient is not
    needed, so 2 there."""
    model = mlp()
    par = tp.TensorParallel(model, four_devices[:2], RULES)
    variables = par.model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(par.model(x) - y))
        return tape.gradient(loss, variables)

    x, y = tf.ones((4, 6), tf.float64), tf.ones((4, 3), tf.float64)
    table = placement.placement_of(step, x, y)
    matmuls = [r for r in table.rows if r.op_type == "MatMul"]
    assert sum(r.device == four_devices[1] for r in matmuls) == 3 * 4 - 1
    assert sum(r.device == four_devices[0] for r in matmuls) == 3 * 4 - 1
    grads = step(x, y)
    with tf.GradientTape() as tape:  # the same gradients as one device
        loss = tf.reduce_mean(tf.square(model(x) - y))
    ref = tape.gradient(loss, model.trainable_variables)
    got = {w.path: g for w, g in zip(variables, grads, strict=True)}
    full = []
    for layer in par.layers:
        k = [got[w.path].numpy() for w in layer.kernels]
        axis = 1 if isinstance(layer, tp.ColumnParallelDense) else 0
        full.append(np.concatenate(k, axis=axis))
        if isinstance(layer, tp.ColumnParallelDense):
            full.append(np.concatenate([got[b.path].numpy() for b in layer.biases]))
        else:
            full.append(got[layer.bias.path].numpy())
    for a, b in zip(full, ref, strict=True):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)


def test_layers_alone_and_bad_rules(four_devices):
    devices = four_devices[:2]
    keras.utils.set_random_seed(1)
    col = tp.ColumnParallelDense(8, devices, activation="relu", dtype="float64")
    x = tf.constant(np.random.default_rng(0).normal(size=(3, 5)))
    y = col(x)  # gathered: one tensor, as a Dense
    dense = keras.layers.Dense(8, activation="relu", dtype="float64")
    dense(x)
    dense.set_weights(col.full_weights())
    np.testing.assert_allclose(y.numpy(), dense(x).numpy(), rtol=1e-12)
    row = tp.RowParallelDense(4, devices, dtype="float64")
    out = row(y)  # a full tensor is split here along its last axis
    ref = keras.layers.Dense(4, dtype="float64")
    ref(y)
    ref.set_weights(row.full_weights())
    np.testing.assert_allclose(out.numpy(), ref(y).numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match="units=6 does not split evenly over 4 devices"):
        tp.ColumnParallelDense(6, four_devices)
    with pytest.raises(ValueError, match="no layer path matches the rules"):
        tp.TensorParallel(mlp(), devices, {"^attn": "column"})
    with pytest.raises(ValueError, match=r"rules\['\^up'\] must be one of"):
        tp.TensorParallel(mlp(), devices, {"^up": "columns"})
    par = tp.TensorParallel(mlp(), devices, RULES)
    with pytest.raises(ValueError, match="jit_compile=True"):
        par.compile("adam", "mse", jit_compile=True)


# ------------------------------------------------------------------ the transformer: heads + MLP
BLOCK_RULES = {"attn$": "heads", "/up$": "column", "/down$": "row"}


def block_kinds(model) -> dict[str, str]:
    """The paths BLOCK_RULES match in the transformer (its blocks' names vary with the number of
    blocks the process has made: block, block_1, ...)."""
    return {f"{b.name}/{a}": k for b in model.layers[1:2]
            for a, k in (("attn", "heads"), ("up", "column"), ("down", "row"))}


def full_of(par, values):
    """``values`` (one per trainable variable of ``par.model``, e.g. gradients) as the original
    model's trainable weights would hold them: written into ``par.model`` and written back (the
    original model of ``par`` is overwritten)."""
    for v, g in zip(par.model.trainable_variables, values, strict=True):
        v.assign(g)
    par.write_back()
    return [w.numpy() for layer in par.original for w in layer.trainable_weights]


@pytest.mark.parametrize("opt,eager", [pytest.param("adam", True, marks=SLOW)])
def test_transformer_heads_and_mlp_fit_equals_keras_on_one_device(four_devices, keras_zoo, opt,
                                                                  eager):
    """The keras_zoo transformer (a Sequential with a Block layer: MultiHeadAttention with 2
    heads, Dense up/down) with its heads and its MLP split over 2 devices, trained by Keras's
    own fit: per-epoch loss and every weight after 3 steps equal Keras on one device. fit runs
    eagerly (tracing the step costs 10 s; the traced step's placement and gradients are the
    next test's; SGD with momentum is checked on the MLP)."""
    z, devices = keras_zoo, four_devices[:2]
    model = z.MODELS["transformer"]()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    par = tp.TensorParallel(model, devices, BLOCK_RULES)
    kinds = block_kinds(model)
    assert par.kinds == kinds
    paths = list(kinds)
    assert par.handoffs == [(paths[1], paths[2])]  # up -> down, no gather
    assert [type(par.parallel_layers[p]).__name__ for p in kinds] == [
        "HeadParallelAttention", "ColumnParallelDense", "RowParallelDense"]
    # the replaced sublayers are the blocks' own: tracked, trained, nothing else left over
    assert len(par.model.trainable_variables) == 30  # 20 - 12 + (15 + 4 + 3)
    z.assert_close(par.model(x).numpy(), model(x).numpy(), "forward")
    fit_equals_keras(z, par, model, z.OPTIMIZERS[opt](), x, y, ref, ref_loss, run_eagerly=eager)
    # each head's q/k/v kernels and their optimizer slots on its device
    slots = {v.path: short_device(v.value.device) for v in par.model.optimizer.variables}
    suffixes = ("_momentum", "_velocity") if opt == "adam" else ("_momentum",)
    for path in paths[::3]:
        for i, shard in enumerate(par.parallel_layers[path].shards):
            for name in ("query_kernel", "key_kernel", "value_kernel", "output_kernel"):
                var = shard[name]
                assert short_device(var.value.device) == devices[i], var.path
                for suffix in suffixes:
                    slot = f"{par.model.optimizer.name}/{var.path.replace('/', '_')}{suffix}"
                    assert slots[slot] == devices[i], slot


@SLOW
def test_transformer_attention_runs_on_each_device(four_devices, keras_zoo):
    """In the placed graph of a traced gradient step of the converted transformer, each device
    runs its heads' attention: 6 einsums forward (q, k, v, scores, weighted values,
    output projection) and 12 backward, and its softmax, on that device; the gradients equal
    Keras's on one device."""
    z, devices = keras_zoo, four_devices[:2]
    model = z.MODELS["transformer"]()
    x, y = z.data_for(model)
    par = tp.TensorParallel(z.clone(model), devices, BLOCK_RULES)
    variables = par.model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(par.model(x, training=True) - y))
        return loss, tape.gradient(loss, variables)

    table = placement.placement_of(step, tf.constant(x[:z.BATCH]), tf.constant(y[:z.BATCH]))
    for d in devices:
        einsums = [r.name for r in table.rows if r.op_type == "Einsum" and r.device == d]
        assert len(einsums) == 6 + 12
        assert sum(n.startswith("gradient_tape/") for n in einsums) == 12
        assert sum(r.op_type == "Softmax" and r.device == d for r in table.rows) == 1
    loss, grads = table.result
    ref_loss, ref_grads = z.first_gradients(model, x, y)
    z.assert_close(float(loss), ref_loss, "loss")
    scale = max(np.abs(g).max() for g in ref_grads)  # the key bias's gradient is 0: noise
    for i, (a, b) in enumerate(zip(full_of(par, grads), ref_grads, strict=True)):
        z.assert_close(a, b.numpy(), f"gradient {i}", scale)


class UsesUpTwice(keras.layers.Layer):
    """A block whose call uses ``up``'s output besides feeding ``down``: no hand-over."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(8, activation="tanh", dtype=self.dtype_policy)
        self.down = keras.layers.Dense(4, dtype=self.dtype_policy)

    def call(self, x):
        h = self.up(x)
        return self.down(h) + h[..., :4]


class MakesUpInBuild(keras.layers.Layer):
    def build(self, input_shape):
        self.up = keras.layers.Dense(8, dtype=self.dtype_policy)
        self.up.build(input_shape)

    def call(self, x):
        return self.up(x)


def test_head_parallel_attention_and_refusals(four_devices):
    devices = four_devices[:2]
    rng = np.random.default_rng(0)
    q = tf.constant(rng.normal(size=(3, 5, 8)))
    kv = tf.constant(rng.normal(size=(3, 4, 6)))
    mha = keras.layers.MultiHeadAttention(4, 3, dtype="float64")
    for value in (q, kv):  # self-attention, and cross-attention with other widths
        mha(q, value)
        heads = tp.HeadParallelAttention.from_attention(mha, devices)
        heads(q, value)
        heads.set_full_weights(*mha.get_weights())
        np.testing.assert_allclose(heads(q, value).numpy(), mha(q, value).numpy(), rtol=1e-12)
        for a, b in zip(heads.full_weights(), mha.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
        mha = keras.layers.MultiHeadAttention(4, 3, dtype="float64")
    with pytest.raises(ValueError, match="attention_mask"):
        heads(q, q, attention_mask=tf.ones((3, 5, 5), tf.bool))
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of the 3 devices"):
        tp.HeadParallelAttention.from_attention(mha, four_devices[:3])
    with pytest.raises(ValueError, match=r"\{'dropout': 0.1\}"):
        tp.HeadParallelAttention.from_attention(
            keras.layers.MultiHeadAttention(2, 4, dropout=0.1), devices)
    with pytest.raises(ValueError, match="'heads' splits a MultiHeadAttention"):
        tp.TensorParallel(mlp(), devices, {"^up": "heads"})
    # a block that uses up's output twice: the column layer gathers, the output is the same
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((6,), dtype="float64"),
                              UsesUpTwice(dtype="float64", name="twice")])
    par = tp.TensorParallel(model, devices, {"/up$": "column", "/down$": "row"})
    assert par.handoffs == [] and par.parallel_layers["twice/up"].gather_output
    x = rng.normal(size=(4, 6))
    np.testing.assert_allclose(par.model(x).numpy(), model(x).numpy(), rtol=1e-12)
    model = keras.Sequential([keras.Input((6,), dtype="float64"),
                              MakesUpInBuild(dtype="float64", name="late")])
    with pytest.raises(ValueError, match="late/up: the MakesUpInBuild rebuilt from its config "
                                         "has no sublayer 'up' before it is built"):
        tp.TensorParallel(model, devices, {"/up$": "column"})


def test_a_column_split_of_softmax_names_the_activation(four_devices):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="up"),
                              keras.layers.Dense(4, activation="softmax", name="probs")])
    with pytest.raises(ValueError, match="Dense probs has activation 'softmax', which "
                                         "normalises over all its units"):
        tp.TensorParallel(model, four_devices[:2], {"probs": "column"})


@keras.saving.register_keras_serializable("accel_tests_tensor")
class _SequentialMLPBlock(keras.layers.Layer):
    """Attention, then an MLP held as a nested ``Sequential`` (keras.io's ``self.ffn``)."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.attn = keras.layers.MultiHeadAttention(2, width // 2, dtype=self.dtype_policy)
        self.ffn = keras.Sequential([
            keras.layers.Dense(2 * width, activation="relu", dtype=self.dtype_policy),
            keras.layers.Dropout(0.0, dtype=self.dtype_policy),
            keras.layers.Dense(width, dtype=self.dtype_policy)])

    def call(self, x, training=False):
        x = x + self.attn(x, x, training=training)
        return x + self.ffn(x, training=training)

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def test_rules_reach_a_sequential_held_by_a_block(four_devices, float64_keras):
    """A block's ``self.ffn = keras.Sequential([...])``: its layers are reached by position
    (``block/ffn/0``), split, and the model trains as Keras's fit on one device (float64, an
    embedding's sparse gradient included)."""
    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((5,), dtype="int32"), keras.layers.Embedding(12, 8, dtype="float64"),
            _SequentialMLPBlock(8, dtype="float64", name="block"),
            keras.layers.GlobalAveragePooling1D(dtype="float64"),
            keras.layers.Dense(3, dtype="float64")])

    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 12, (48, 5)).astype("int32"), rng.integers(0, 3, 48)
    ref = make()
    ref.compile(optimizer=keras.optimizers.Adam(0.02), run_eagerly=True,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    model = make()
    par = tp.TensorParallel(model, four_devices[:2],
                            {"block/attn": "heads", "block/ffn/0": "column",
                             "block/ffn/2": "row"},
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            optimizer=keras.optimizers.Adam(0.02))
    assert par.kinds == {"block/attn": "heads", "block/ffn/0": "column",
                         "block/ffn/2": "row"}
    for path in ("block/ffn/0", "block/ffn/2"):
        shards = [w for w in par.parallel_layers[path].weights if "kernel" in w.path]
        assert [short_device(w.value.device) for w in shards] == four_devices[:2], path
    par.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for a, b in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale)



def regularized(seed=0):
    """A functional model whose split layers carry every regularizer that adds up over shards:
    attention (kernel L2, bias L2: its key bias has no gradient but rounding noise, which an L1
    penalty's sign would turn into a step), a column Dense (kernel L2, activity L1: its output
    is handed over as slices, each penalised), a row Dense (kernel L1L2, bias L1)."""
    keras.utils.set_random_seed(seed)
    r = keras.regularizers
    inputs = keras.Input((5, 8), dtype="float64")
    a = keras.layers.MultiHeadAttention(2, 4, kernel_regularizer=r.L2(0.01),
                                        bias_regularizer=r.L2(0.01), dtype="float64",
                                        name="attn")(inputs, inputs)
    h = keras.layers.Add(dtype="float64")([inputs, a])
    u = keras.layers.Dense(16, activation="relu", kernel_regularizer=r.L2(0.02),
                           activity_regularizer=r.L1(0.001), dtype="float64", name="up")(h)
    d = keras.layers.Dense(8, kernel_regularizer=r.L1L2(0.001, 0.01),
                           bias_regularizer=r.L1(0.01), dtype="float64", name="down")(u)
    flat = keras.layers.Flatten(dtype="float64")(d)
    return keras.Model(inputs, keras.layers.Dense(3, dtype="float64", name="head")(flat))


@SLOW
def test_regularizers_that_add_up_over_shards_train_as_keras(four_devices, keras_zoo,
                                                             float64_keras):
    """Each shard carries its layer's L1/L2 regularizer, so the converted model's losses are
    the original's (summed shard by shard) and Keras's fit trains both alike (float64, 3
    steps); a regularizer that does not add up over shards is refused with a way out."""
    z = keras_zoo
    model = regularized()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS["adam"](), x, y)
    par = tp.TensorParallel(model, four_devices[:2],
                            {"^attn$": "heads", "^up$": "column", "^down$": "row"})
    assert par.handoffs == [("up", "down")]
    model(x[:4]), par.model(x[:4])  # the activity penalty is the last call's
    z.assert_close(sum(float(t) for t in par.model.losses),
                   sum(float(t) for t in model.losses), "the penalties")
    assert len(par.model.losses) > len(model.losses)  # one per shard
    fit_equals_keras(z, par, model, z.OPTIMIZERS["adam"](), x, y, ref, ref_loss)
    back = keras.Model.from_config(par.model.get_config(), custom_objects={
        c.__name__: c for c in (tp.ColumnParallelDense, tp.RowParallelDense,
                                tp.HeadParallelAttention)})
    assert type(back.get_layer("up_column").kernel_regularizer) is keras.regularizers.L2

    orth = keras.Sequential([keras.Input((6,), dtype="float64"), keras.layers.Dense(
        4, kernel_regularizer=keras.regularizers.OrthogonalRegularizer(0.01), dtype="float64",
        name="up")])
    with pytest.raises(ValueError, match="OrthogonalRegularizer.*leave this layer whole"):
        tp.TensorParallel(orth, four_devices[:2], {"^up$": "column"})
