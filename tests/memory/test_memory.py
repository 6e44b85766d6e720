"""accel.memory.estimate / measure / config / savings: estimates against hand counts and real
tensors, config builders, recomputation and mixed precision giving the same gradients."""

import numpy as np
import pytest
import tensorflow as tf

from accel import timing
from accel.memory import config as memory_config
from accel.memory import estimate as memory
from accel.memory import measure
from accel.memory import savings as memory_savings

L = tf.keras.layers


def _mlp(policy="float32"):
    return tf.keras.Sequential([tf.keras.Input((512,)), L.Dense(512, "relu", dtype=policy),
                                L.Dense(512, "relu", dtype=policy), L.Dense(10, dtype=policy)])


def _cnn(policy="float32"):
    return tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)),
        L.Conv2D(16, 3, padding="same", activation="relu", dtype=policy),
        L.MaxPooling2D(dtype=policy),
        L.Conv2D(32, 3, padding="same", activation="relu", dtype=policy),
        L.MaxPooling2D(dtype=policy), L.Flatten(dtype=policy), L.Dense(10, dtype=policy)])


def _wide(policy="float32"):
    return tf.keras.Sequential([tf.keras.Input((784,)), L.Dense(256, "tanh", dtype=policy),
                                L.Dense(256, "relu", dtype=policy), L.Dense(10, dtype=policy)])


MODELS = {"mlp": (_mlp, (512,), 256), "cnn": (_cnn, (32, 32, 3), 64), "wide": (_wide, (784,), 128)}


def test_tensor_bytes_and_weights_against_hand_counts():
    # float32 3x4 (48 B) + float16 5 (10 B) + int64 2x2 (32 B) + bool 7 (7 B)
    tensors = [tf.zeros((3, 4)), tf.zeros((5,), tf.float16), tf.zeros((2, 2), tf.int64),
               tf.zeros((7,), tf.bool)]
    assert memory.tensor_bytes(tensors) == 48 + 10 + 32 + 7
    assert memory.tensor_bytes([tf.Variable(tf.zeros((10, 10)))]) == 400
    assert memory.nbytes((2, 3, 4), "bfloat16") == 48
    # MLP 512-512-512-10: (512*512 + 512) * 2 + 512*10 + 10 = 530,442 parameters, 4 bytes each
    est = memory.estimate_training_memory(_mlp(), "adam")
    assert est.weights == est.gradients == 530_442 * 4
    assert est.optimizer_slots == 2 * 530_442 * 4  # Adam: m and v
    assert memory.estimate_training_memory(_mlp(), "momentum").optimizer_slots == 530_442 * 4
    assert memory.estimate_training_memory(_mlp(), "sgd").optimizer_slots == 0
    # CNN: conv 3x3x3x16 + 16, conv 3x3x16x32 + 32, dense (8*8*32)x10 + 10 = 25,578 parameters
    assert memory.estimate_training_memory(_cnn(), "sgd").weights == 25_578 * 4


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("optimizer", sorted(memory.OPTIMIZERS))
def test_state_bytes_exact(name, optimizer):
    model = MODELS[name][0]()
    opt = memory.make_optimizer(optimizer)
    opt.build(model.trainable_variables)
    x = tf.zeros((4, *MODELS[name][1]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    est = memory.estimate_training_memory(model, optimizer)
    assert est.weights == memory.tensor_bytes(model.trainable_variables)
    assert est.gradients == memory.tensor_bytes(grads)
    assert est.optimizer_slots == memory.tensor_bytes(memory.slot_variables(opt))
    scalars = [v for v in opt.variables if len(v.shape) == 0]
    assert memory.tensor_bytes(scalars) == 12  # iteration (int64) + learning rate (float32)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("policy", sorted(memory.POLICIES))
def test_activations_within_10_percent(name, policy):
    build, shape, batch = MODELS[name]
    model = build(policy)
    est = memory.estimate_training_memory(model, "adam", policy, batch_size=batch)
    kept = measure.tape_kept_bytes(model, tf.zeros((batch, *shape)))
    assert abs(est.activations / kept - 1) <= 0.10, (est.activations, kept)


def test_tape_kept_leaves_out_summed_gradients():
    # a is read twice (a * a): the tape keeps a, once; the AddN that sums a's two gradients is
    # made outside the gradient_tape/ scope and is a gradient, not an activation
    inp = tf.keras.Input((3,))
    a = L.Dense(4, use_bias=False)(inp)
    model = tf.keras.Model(inp, a * a)
    assert measure.tape_kept_bytes(model, tf.zeros((5, 3))) == 5 * 4 * 4


def test_variables_list_and_mixed_weights_are_float32():
    model = _mlp("mixed_float16")
    est = memory.estimate_training_memory(model.trainable_variables, "momentum", "mixed_float16")
    assert est.weights == memory.tensor_bytes(model.trainable_variables)
    assert est.optimizer_slots == est.weights and est.activations == 0
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    acc = memory.mixed_precision_accounting("adam")
    assert sum(acc["classic mixed"].values()) == sum(acc["float32"].values()) == 16


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                    reason="the workspace rule of accel.memory is calibrated on CPU kernels")
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_step_peak_within_20_percent(name):
    build, shape, batch = MODELS[name]
    model = build()
    x, y = tf.random.normal((batch, *shape)), tf.zeros((batch,), tf.int32)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    peak = measure.measure_step_peak(model, memory.make_optimizer("adam"), x, y, loss)
    work = measure.measure_conv_workspace(model, batch)
    est = memory.estimate_training_memory(model, "adam", batch_size=batch, conv_workspace=work)
    assert abs(est.total / peak - 1) <= 0.20, (est.as_dict(), peak)


def test_conv_workspace_measured_and_used():
    assert measure.measure_conv_workspace(_mlp(), 64) == 0
    work = measure.measure_conv_workspace(_cnn(), 64)
    assert work > 0
    est = memory.estimate_training_memory(_cnn(), "adam", batch_size=64, conv_workspace=work)
    assert est.workspace == max(work, memory.activation_bytes(_cnn(), 64, conv_workspace=0)[1])
    default = memory.estimate_training_memory(_cnn(), "adam", batch_size=64)
    assert default.workspace == memory.CPU_CONV_WORKSPACE
    with pytest.raises(ValueError, match="conv_workspace must be >= 0 bytes or None, got -1"):
        memory.estimate_training_memory(_cnn(), batch_size=64, conv_workspace=-1)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        measure.measure_conv_workspace(_cnn(), 0)


def test_estimate_rejects_bad_values():
    with pytest.raises(ValueError, match=r"optimizer must be one of \['adam', 'momentum', 'sgd'\], "
                                         "got 'adagrad'"):
        memory.estimate_training_memory([], "adagrad")
    with pytest.raises(ValueError, match="policy must be one of .* got 'float64'"):
        memory.estimate_training_memory([], "adam", "float64")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        memory.activation_bytes(_mlp(), 0)
    table = memory.format_estimates({"a": memory.MemoryEstimate(2**20, 2**20, 0)})
    assert "total" in table and "2.00" in table


def test_tf1_config_round_trip():
    kwargs = dict(allow_growth=True, memory_fraction=0.4, visible_devices=(1, 0),
                  inter_op_threads=2, intra_op_threads=1, use_per_session_threads=True)
    config = memory_config.tf1_config(**kwargs)
    parsed = tf.compat.v1.ConfigProto.FromString(config.SerializeToString())
    assert memory_config.tf1_config_fields(parsed) == kwargs
    assert parsed.gpu_options.visible_device_list == "1,0"
    assert memory_config.tf1_config_fields(memory_config.tf1_config()) == {}


@pytest.mark.parametrize("kwargs, message", [
    (dict(memory_fraction=0.0), r"in \(0, 1\]; got 0.0"),
    (dict(memory_fraction=1.5), r"in \(0, 1\]; got 1.5"),
    (dict(visible_devices=[0, 0]), r"distinct GPU indices >= 0, got \[0, 0\]"),
    (dict(visible_devices=[-1]), r"distinct GPU indices >= 0, got \[-1\]"),
    (dict(intra_op_threads=-2), "intra_op_threads must be an int >= 0 .* got -2")])
def test_tf1_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        memory_config.tf1_config(**kwargs)


def test_gpu_plan():
    plan = memory_config.gpu_memory_plan(memory_limit_mb=[512, 256], visible=[0])
    assert plan.memory_limits_mb == (512, 256) and plan.env() == {}
    assert len(plan.calls()) == 2
    assert memory_config.gpu_memory_plan(growth=True).env() == {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    with pytest.raises(ValueError, match="cannot both be set"):
        memory_config.gpu_memory_plan(growth=True, memory_limit_mb=1024)
    with pytest.raises(ValueError, match="memory_limit_mb must be positive ints .* got -1"):
        memory_config.gpu_memory_plan(memory_limit_mb=-1)
    with pytest.raises(ValueError, match=r"visible=\[3\] names a GPU index that does not exist"):
        memory_config.apply_gpu_memory_plan(memory_config.gpu_memory_plan(visible=[3]), gpus=[])
    with pytest.raises(ValueError):  # TensorFlow's own refusal: a CPU has no memory limit
        memory_config.apply_gpu_memory_plan(memory_config.gpu_memory_plan(memory_limit_mb=64),
                                            gpus=tf.config.list_physical_devices("CPU"))


def test_gradient_step_is_chapter_04s_loop():
    # chapter 04's residual blocks written out: h + relu(h @ w1) @ w2, loss mean(h^2)
    params = memory_savings.residual_mlp(blocks=2, width=8)
    x = tf.random.stateless_normal((16, 8), seed=(0, 1))
    with tf.GradientTape() as tape:
        h = x
        for w1, w2 in params:
            h = h + tf.matmul(tf.nn.relu(tf.matmul(h, w1)), w2)
        loss = tf.reduce_mean(tf.square(h))
    by_hand = tape.gradient(loss, [v for pair in params for v in pair])
    for variant in ("plain", "recompute"):
        for a, b in zip(memory_savings.gradient_step(params, x, variant), by_hand, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_recompute_and_half_precision_gradients_match():
    params = memory_savings.residual_mlp(blocks=3, width=8)
    x = tf.random.normal((16, 8), seed=1)
    ref = memory_savings.gradient_step(params, x, "plain")
    for variant, tol in [("recompute", 1e-6), ("float16", 5e-2), ("bfloat16", 1e-1)]:
        got = memory_savings.gradient_step(params, x, variant)
        for g, r in zip(got, ref, strict=True):  # half precision: relative error of the whole
            err = np.linalg.norm(tf.cast(g, tf.float32) - r) / np.linalg.norm(r)
            assert err <= tol, (variant, err)
        if variant == "recompute":
            for g, r in zip(got, ref, strict=True):
                np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="variant must be one of .* got 'int8'"):
        memory_savings.gradient_step(params, x, "int8")


@pytest.mark.slow
def test_measure_variants_recompute_saves_memory():
    # in a fresh process: after the rest of the suite, pooled chunks blur small peaks (a full
    # run once measured float16 0.959 MiB against plain 0.950)
    res = memory_savings.measure_variants_anywhere(fresh=True, batch=256, blocks=4, width=32,
                                                   repeat=1)
    assert res["recompute"]["peak_mib"] < res["plain"]["peak_mib"]
    assert res["float16"]["peak_mib"] < res["plain"]["peak_mib"]


def test_measure_peaks_at_least_what_the_plain_step_keeps():
    """Batch 256, width 64, 4 blocks: the plain step keeps each block's input (256 x 64) and
    hidden ReLU output (256 x 256), 4 x (64 + 256) KiB = 1.25 MiB of float32; recomputation
    keeps the 4 inputs and rebuilds one block at a time."""
    peaks = memory_savings.measure_peaks(batch=256, blocks=4, width=64,
                                         variants=("plain", "recompute"))
    assert set(peaks) == {"plain", "recompute"}
    assert peaks["plain"] >= 1.25 and peaks["recompute"] < peaks["plain"]
    with pytest.raises(ValueError, match="variant must be one of .* got 'int8'"):
        memory_savings.measure_peaks(batch=8, blocks=1, width=4, variants=("int8",))


def test_forward_seconds_times_the_plain_forward():
    assert memory_savings.forward_seconds(batch=16, blocks=2, width=8, repeat=1) > 0
    with pytest.raises(ValueError):
        memory_savings.forward_seconds(repeat=0)


@pytest.mark.slow
def test_threads_in_fresh_process():
    assert timing.matmul_seconds_with_threads(1, n=64, repeat=1) > 0
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        timing.matmul_seconds_with_threads(0)


def test_measure_variants_rejects_bad_arguments():
    with pytest.raises(ValueError, match="variant must be one of .* got 'int8'"):
        memory_savings.measure_variants(batch=8, blocks=1, width=4, variants=("plain", "int8"))
    with pytest.raises(ValueError, match="repeat"):
        memory_savings.measure_variants(batch=8, blocks=1, width=4, repeat=0)


def test_input_gradient_needed_only_after_a_trainable_layer():
    # _cnn: Conv2D, MaxPooling2D, Conv2D, ...: the first convolution reads the batch (no
    # gradient asked for it), the second reads the first block's output (its gradient flows on)
    cnn = _cnn()
    assert [measure.input_gradient_needed(cnn, i) for i in (0, 1, 2)] == [False, True, True]
    dense_first = tf.keras.Sequential([tf.keras.Input((8, 8, 3)), L.Dense(4),
                                       L.Conv2D(2, 3)])
    assert measure.input_gradient_needed(dense_first, 1)
    with pytest.raises(ValueError, match=r"index must be an int in \[0, 6\)"):
        measure.input_gradient_needed(cnn, 6)
