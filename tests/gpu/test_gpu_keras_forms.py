"""Every Keras form of ``accel.parallel`` on GPUs (`make gpu-check`; skipped without one): each
trains a float64 Keras model on two (logical) GPUs and must equal Keras's own ``fit`` of the same
model on the CPU (same optimizer, same data), with the form's variables on the GPUs.

Each check runs in a fresh process (``devices.setup`` fixes the devices for the life of a
process), with TF32 off (``test_gpu_paths``). ``ACCEL_GPU_CHECK_KIND=cpu`` runs the same code on
logical CPUs: a dry run of the tests themselves on a machine without a GPU."""

import textwrap

import pytest

pytestmark = pytest.mark.gpu

# the model, data and reference every check below shares (inside the child process)
COMMON = """
import keras
from accel.placement import short_device

def mlp(seed=0, names=("up1", "down1", "up2", "down2")):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), dtype="float64")] + [
        keras.layers.Dense(n, activation=a, dtype="float64", name=name)
        for (n, a), name in zip([(16, "relu"), (16, "tanh"), (12, "relu"), (3, None)], names)])

x = rng.normal(size=(48, 6)); y = rng.normal(size=(48, 3))

def keras_on_cpu(model, optimizer):
    ref = keras.models.clone_model(model); ref.set_weights(model.get_weights())
    with tf.device("/cpu:0"):
        ref.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
        ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return ref.get_weights()

def same(weights, ref, what):
    scale = max(abs(w).max() for w in ref)
    for i, (a, b) in enumerate(zip(weights, ref, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{what} {i}")

def on_devices(variables):
    return {short_device(v.value.device) for v in variables}
"""


@pytest.fixture
def check(run_on):
    """``check(body)``: ``body`` after ``COMMON`` on two devices in a fresh process."""
    return lambda body: run_on(2, COMMON + textwrap.dedent(body))


def test_towers_and_mirrored_strategy(check):
    check("""
        from accel.parallel.data import DataParallel
        from accel.parallel.mirrored import Mirrored
        model = mlp()
        ref = keras_on_cpu(model, keras.optimizers.Adam(0.01))
        towers = DataParallel(model, names, loss="mse", optimizer=keras.optimizers.Adam(0.01))
        towers.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        same(model.get_weights(), ref, "towers")
        assert on_devices(towers.copy.weights) == {names[0]}

        def build():
            m = mlp()
            m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)
            return m
        mirrored = Mirrored(build, names)
        mirrored.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        same(mirrored.model.get_weights(), ref, "MirroredStrategy")
    """)


def test_model_parallel(check):
    check("""
        from accel.parallel.model import ModelParallel
        model = mlp()
        ref = keras_on_cpu(model, keras.optimizers.Adam(0.01))
        split = ModelParallel(model, names, loss="mse", optimizer=keras.optimizers.Adam(0.01))
        split.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        same(model.get_weights(), ref, "split")
        for p, device in enumerate(names):
            assert on_devices(split.variables(0, p)) == {device}
    """)


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pipeline(check, schedule, chunks):
    check(f"""
        from accel.parallel.pipeline_exec import Pipeline
        model = mlp()
        ref = keras_on_cpu(model, keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))
        pipe = Pipeline(model, names, loss="mse",
                        optimizer=keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
                        num_microbatches=4, schedule={schedule!r}, num_chunks={chunks})
        pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        same(model.get_weights(), ref, "pipeline {schedule}")
    """)


def test_tensor_parallel_dense_pairs_and_heads(check):
    check("""
        from accel.parallel.tensor import TensorParallel
        model = mlp()
        ref = keras_on_cpu(model, keras.optimizers.Adam(0.01))
        tp = TensorParallel(model, names, {"^up": "column", "^down": "row"})
        tp.compile(keras.optimizers.Adam(0.01), "mse")
        tp.model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        tp.write_back()
        same(model.get_weights(), ref, "tensor parallel")
        for layer in tp.layers:
            assert [short_device(k.value.device) for k in layer.kernels] == list(names)
    """)


def test_tensor_parallel_transformer_heads_and_mlp(check):
    check("""
        from accel.parallel.tensor import TensorParallel

        class Block(keras.layers.Layer):
            def __init__(self, width, heads, **kwargs):
                super().__init__(**kwargs)
                self.width, self.heads = width, heads
                self.norm = keras.layers.LayerNormalization(dtype=self.dtype_policy)
                self.attn = keras.layers.MultiHeadAttention(heads, width // heads,
                                                            dtype=self.dtype_policy)
                self.up = keras.layers.Dense(2 * width, activation="gelu",
                                             dtype=self.dtype_policy)
                self.down = keras.layers.Dense(width, dtype=self.dtype_policy)

            def call(self, x):
                h = self.norm(x)
                x = x + self.attn(h, h)
                return x + self.down(self.up(x))

            def get_config(self):
                return {**super().get_config(), "width": self.width, "heads": self.heads}

        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5, 8), dtype="float64"),
                                  Block(8, 2, dtype="float64"),
                                  keras.layers.GlobalAveragePooling1D(dtype="float64"),
                                  keras.layers.Dense(3, dtype="float64")])
        tokens = rng.normal(size=(48, 5, 8))
        ref = keras.models.clone_model(model); ref.set_weights(model.get_weights())
        with tf.device("/cpu:0"):
            ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=True)
            ref.fit(tokens, y, batch_size=16, shuffle=False, verbose=0)
        tp = TensorParallel(model, names, {"attn$": "heads", "/up$": "column", "/down$": "row"})
        tp.compile(keras.optimizers.Adam(0.01), "mse")
        tp.model.fit(tokens, y, batch_size=16, shuffle=False, verbose=0)
        tp.write_back()
        same(model.get_weights(), ref.get_weights(), "tensor-parallel transformer")
        assert sorted(tp.kinds.values()) == ["column", "heads", "row"], tp.kinds
    """)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages(check, stage):
    check(f"""
        from accel.parallel.zero import Zero
        model = mlp()
        ref = keras_on_cpu(model, keras.optimizers.Adam(0.01))
        zero = Zero(model, names, loss=keras.losses.mean_squared_error,
                    optimizer=keras.optimizers.Adam(0.01), stage={stage})
        zero.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        same(model.get_weights(), ref, "ZeRO stage {stage}")
        assert set(zero.held_bytes()) == set(names)
    """)


def test_offload_to_the_host(run_on):
    run_on(3, COMMON + textwrap.dedent("""
        from accel.parallel.offload import Offload
        devs = names[:2]
        host = "/device:CPU:0" if "GPU" in names[0] else names[2]  # dry run: a third CPU
        model = mlp()
        ref = keras_on_cpu(model, keras.optimizers.Adam(0.01))
        off = Offload(model, devs, host=host, loss=keras.losses.mean_squared_error,
                      optimizer=keras.optimizers.Adam(0.01))
        off.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        same(model.get_weights(), ref, "offload")
        slots = [v for v in off.optimizer.variables if len(v.shape)]
        assert on_devices(slots) == {host}, on_devices(slots)
    """))


def test_mixture_of_experts_experts_on_the_devices(check):
    check("""
        from accel.parallel.moe import MoE
        tokens = tf.constant(rng.normal(size=(4, 5, 6)))
        keras.utils.set_random_seed(0)
        spread = MoE(4, 8, names, k=2, capacity_factor=2.0, dtype="float64")
        keras.utils.set_random_seed(0)
        on_cpu = MoE(4, 8, ["/cpu:0"], k=2, capacity_factor=2.0, dtype="float64")
        spread(tokens), on_cpu(tokens)  # built
        on_cpu.set_weights(spread.get_weights())
        # one group of tokens per device: the CPU layer routes each device's group on its own
        with tf.GradientTape() as tape:
            out = spread(tokens)
            loss = tf.reduce_sum(out ** 2)
        grads = tape.gradient(loss, spread.trainable_weights)
        with tf.GradientTape() as tape:
            ref = tf.concat([on_cpu(t) for t in tf.split(tokens, len(names))], axis=0)
            ref_loss = tf.reduce_sum(ref ** 2)
        ref_grads = tape.gradient(ref_loss, on_cpu.trainable_weights)
        np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-8)
        same([g.numpy() for g in grads], [g.numpy() for g in ref_grads], "MoE gradient")
        assert {spread.device_of(e) for e in range(4)} == set(names)
    """)
