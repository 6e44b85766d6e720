"""ZeRO stages 0-3 by hand against Keras' Adam on one device (float64: the sums are reordered),
the bytes each device holds against the paper's formulas, the bytes sent against the formulas."""

import numpy as np
import pytest
import tensorflow as tf

from accel import collectives
from accel.costmodel import zero as cm
from accel.models import mlp_apply, mlp_init
from accel.parallel.layers import dense, linear
from accel.parallel.zero import ZeroStep, flatten_layers
from accel.training import squared_error

# layer sizes whose flat vectors (w + b) divide by 2 and 4: 8*12+12 = 108, 12*4+4 = 52
# Keras' Adam rounds its learning rate and betas to float32 even for float64 variables: values
# exact in float32 make the float64 reference exact
HYPER = {"learning_rate": 2**-7, "beta_1": 0.875, "beta_2": 1 - 2**-10}
SIZES = [8, 12, 4]


def fns(params):
    """``mlp_apply``'s layers: ReLU, then linear last."""
    return [dense] * (len(params) // 2 - 1) + [linear]


def _data(batch=16, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, SIZES[0])), rng.normal(size=(batch, SIZES[-1]))


def _reference(params, x, y, steps):
    """Keras' own Adam on one device, the whole batch, float64."""
    vs = [tf.Variable(p.astype(np.float64)) for p in params]
    opt = tf.keras.optimizers.Adam(**HYPER)
    losses = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(y, mlp_apply(vs, x)))
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs, strict=False))
        losses.append(float(loss))
    return [v.numpy() for v in vs], losses


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_weights_after_steps_equal_single_device_adam(four_devices, stage, n):
    devs = four_devices[:n]
    params = mlp_init(SIZES, seed=3)
    x, y = _data()
    ref, ref_losses = _reference(params, x, y, steps=4)
    step = ZeroStep(params, devs, stage, squared_error, **HYPER, dtype=tf.float64,
                    layer_fns=fns(params))
    xs = collectives.place(list(np.split(x, n)), devs)
    ys = collectives.place(list(np.split(y, n)), devs)
    losses = [float(sum(v.numpy() for v in step.step(xs, ys))) for _ in range(4)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    for device in range(n if stage < 3 else 1):  # every copy is the same
        for got, want in zip(step.weights(device), ref, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_held_bytes_equal_the_formula(four_devices, stage):
    params = mlp_init(SIZES)
    step = ZeroStep(params, four_devices, stage, squared_error, layer_fns=fns(params))
    psi = 108 + 52
    assert step.params == step.padded_params == psi
    want = cm.zero_bytes_per_device(psi, 4, stage, "fp32")
    for row in step.held_bytes().values():
        assert row == want
    # by hand, stage 2: 4 * 160 weights, 4 * 40 gradients, 8 * 40 Adam
    if stage == 2:
        assert want["total"] == 640 + 160 + 320


def test_padding_is_counted(four_devices):
    flat = flatten_layers(mlp_init([2, 2]), 4)  # 2 x 2 + 2 = 6 parameters, padded to 8
    assert [len(f) for f in flat] == [8]
    step = ZeroStep(mlp_init([2, 2]), four_devices, 3, squared_error, layer_fns=[linear])
    assert step.padded_params == 8 and step.params == 6
    assert step.held_bytes()[four_devices[0]] == cm.zero_bytes_per_device(
        6, 4, 3, "fp32", pad=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_sent_equal_the_formula(four_devices, stage):
    n = 4
    params = mlp_init(SIZES)
    x, y = _data()
    step = ZeroStep(params, four_devices, stage, squared_error, layer_fns=fns(params))
    xs = collectives.place([a.astype(np.float32) for a in np.split(x, n)], four_devices)
    ys = collectives.place([a.astype(np.float32) for a in np.split(y, n)], four_devices)
    sent = collectives.sent_bytes(step.step, xs, ys)
    want = cm.zero_comm_bytes(160, n, stage, "fp32")
    # by hand: 160 floats = 640 bytes; 2 * 3/4 * 640 = 960; stage 3: 1440
    assert want == (1440 if stage == 3 else 960)
    assert sent == {d: want for d in four_devices}


def test_bad_input(four_devices):
    params = mlp_init(SIZES)
    with pytest.raises(ValueError, match="stage must be one of"):
        ZeroStep(params, four_devices, 4, squared_error, layer_fns=fns(params))
    with pytest.raises(ValueError, match="learning_rate must be a number > 0"):
        ZeroStep(params, four_devices, 1, squared_error, learning_rate=0,
                 layer_fns=fns(params))
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        flatten_layers(params, 0)
    with pytest.raises(ValueError, match="devices is empty"):
        ZeroStep(params, [], 1, squared_error, layer_fns=fns(params))
    with pytest.raises(ValueError, match="params must alternate weight, bias; got 3"):
        ZeroStep(params[:3], four_devices, 1, squared_error, layer_fns=fns(params))
    with pytest.raises(ValueError, match="layer_fns must be one function per layer"):
        ZeroStep(params, four_devices, 1, squared_error, layer_fns=[dense])
    with pytest.raises(ValueError, match="layer_fns must be one function per layer"):
        ZeroStep(params, four_devices, 1, squared_error, layer_fns=mlp_apply)


def _tanh(params, h):
    return tf.tanh(tf.matmul(h, params[0]) + params[1])


@pytest.mark.parametrize("stage", [0, 3])
def test_the_layers_are_the_callers(four_devices, steps_like_adam, stage):
    """Any layer functions, not only the MLP's: tanh layers, the last one too (float64)."""
    params = mlp_init(SIZES, seed=4)
    x, y = _data()
    step = ZeroStep(params, four_devices[:2], stage, squared_error, **HYPER, dtype=tf.float64,
                    layer_fns=[_tanh, _tanh])
    vs, _, _ = steps_like_adam(step, params, x, y, four_devices[:2], 3, HYPER,
                               lambda w, h: _tanh(w[2:], _tanh(w[:2], h)))
    for got, want in zip(step.weights(0), vs, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)


DEEP = [6, 8, 8, 8, 4]  # four layers: prefetch has something to order


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stage3_prefetch_equals_single_device_adam(four_devices, steps_like_adam, prefetch):
    """The gather order changes nothing computed: weights after 3 steps equal Keras' Adam on one
    device (float64), and the bytes sent equal the formula."""
    params = mlp_init(DEEP, seed=5)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(8, DEEP[0])), rng.normal(size=(8, DEEP[-1]))
    step = ZeroStep(params, four_devices, 3, squared_error, **HYPER, dtype=tf.float64,
                    layer_fns=fns(params), prefetch=prefetch)
    vs, xs, ys = steps_like_adam(step, params, x, y, four_devices, 3, HYPER, mlp_apply)
    for got, want in zip(step.weights(), vs, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
    sent = collectives.sent_bytes(step.step, xs, ys)  # identities and control edges: no bytes
    # by hand, float64: 3 x (4 - 1) / 4 x 8 bytes x 236 parameters = 4248 per device
    assert step.padded_params == 236
    assert sent == {d: 4248 for d in four_devices}


def _waits(step, xs, ys) -> dict[str, set[str]]:
    """Gather scope -> the layer scopes its identities wait for (control inputs), read from the
    traced graph."""
    graph = step.step.get_concrete_function(xs, ys).graph
    out = {}
    for op in graph.get_operations():
        scope = op.name.split("/")[0] if "gather_" in op.name.split("/")[0] else None
        if scope is None:
            continue
        for c in op.control_inputs:
            out.setdefault(scope, set()).add(c.name.removeprefix("gradient_tape/").split("/")[0])
    return out


@pytest.mark.parametrize("prefetch", [None, 0, 1])
def test_each_gather_waits_for_the_layer_prefetch_plus_one_before(four_devices, prefetch):
    """Forward: the gather of layer l waits for layer l - 1 - p; backward (last layer first):
    for layer l + 1 + p's backward, or for the end of the forward pass; None: nothing."""
    params = mlp_init(DEEP, seed=5)
    step = ZeroStep(params, four_devices, 3, squared_error, layer_fns=fns(params),
                    prefetch=prefetch)
    xs = collectives.place([tf.ones((2, DEEP[0]))] * 4, four_devices)
    ys = collectives.place([tf.ones((2, DEEP[-1]))] * 4, four_devices)
    waits = _waits(step, xs, ys)
    if prefetch is None:
        assert waits == {}
        return
    p, last = prefetch, len(DEEP) - 2
    want = {f"fwd_gather_{k}": {f"fwd_layer_{k - 1 - p}"} for k in range(len(DEEP) - 1)
            if k - 1 - p >= 0}
    for k in range(len(DEEP) - 1):
        later = k + 1 + p
        want[f"bwd_gather_{k}"] = ({f"bwd_layer_{later}"} if later <= last
                                   else {f"fwd_layer_{last}"})
    assert waits == want


def test_prefetch_is_for_stage_3(four_devices):
    params = mlp_init(SIZES)
    with pytest.raises(ValueError, match="prefetch orders stage 3's gathers; stage 2"):
        ZeroStep(params, four_devices, 2, squared_error, layer_fns=fns(params), prefetch=1)
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        ZeroStep(params, four_devices, 3, squared_error, layer_fns=fns(params), prefetch=-1)
