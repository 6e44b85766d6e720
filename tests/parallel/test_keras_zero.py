"""ZeRO stages 1-3 (``Zero``), optimizer offload (``Offload``) and gradient accumulation
(``accumulation_steps``; ``Accumulating`` on one device) for Keras models and Keras optimizers,
against Keras training the same model on one device: a plain tape loop with the same Keras
optimizer class (loss and weights after 3 steps, float64, rtol 1e-5), and for accumulation
Keras's own ``fit`` with ``gradient_accumulation_steps``; bytes held against a hand count,
optimizer slots on their devices, refusals."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from accel.parallel.accumulate import Accumulating
from accel.parallel.offload import Offload
from accel.parallel.zero import Zero
from accel.placement import short_device

SLOW = pytest.mark.slow  # attention run eagerly for several steps: make test, not make quick
OPTIMIZERS = {
    # weight decay on all but the biases (by name), and the global norm clipped
    "adamw_clipped": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
}


def _device(v) -> str:
    """Where a variable (TensorFlow's or Keras's) lives."""
    return short_device(v.value.device if isinstance(v, keras.Variable) else v.device)


def _optimizer(z, name):
    return z.OPTIMIZERS[name]() if name in z.OPTIMIZERS else OPTIMIZERS[name]()


def one_device(z, model, optimizer, x, y, shards):
    """Keras on one device: per batch, the loss averaged over ``shards`` parts each run through
    the model on its own (its own BatchNorm statistics); the moving statistics are kept from
    the first part only (each later part's update is undone), as the forms keep the first
    device's. Returns the trained copy and the mean loss."""
    ref, losses = z.clone(model), []
    for s in range(z.STEPS):
        batch = slice(s * z.BATCH, (s + 1) * z.BATCH)
        xs, ys = tf.split(x[batch], shards), tf.split(y[batch], shards)
        with tf.GradientTape() as tape:
            parts = []
            for k, (xk, yk) in enumerate(zip(xs, ys, strict=True)):
                kept = [v.numpy() for v in ref.non_trainable_weights]
                parts.append(tf.reduce_mean(keras.losses.mean_squared_error(
                    yk, ref(xk, training=True))))
                if k:
                    for v, a in zip(ref.non_trainable_weights, kept, strict=True):
                        v.assign(a)
            loss = tf.add_n(parts) / shards
        optimizer.apply(tape.gradient(loss, ref.trainable_weights), ref.trainable_weights)
        losses.append(float(loss))
    return ref, float(np.mean(losses))


_FITTED = {}


def keras_accumulating_fit(z, name, opt, k):
    """Keras's own ``fit`` of model ``name`` with optimizer ``opt`` and
    ``gradient_accumulation_steps=k`` on batches ``k`` times smaller (eager; kept for the
    cases that share it)."""
    if (name, opt, k) not in _FITTED:
        model = z.MODELS[name]()
        ref, loss = _accumulating_fit(z, model, _optimizer(z, opt), *z.data_for(model), k)
        _FITTED[name, opt, k] = ref.get_weights(), loss
    return _FITTED[name, opt, k]


def _accumulating_fit(z, model, optimizer, x, y, k):
    ref = z.clone(model)
    opt = optimizer.__class__.from_config({**optimizer.get_config(),
                                           "gradient_accumulation_steps": k})
    ref.compile(optimizer=opt, loss="mse", run_eagerly=True)
    hist = ref.fit(x, y, batch_size=z.BATCH // k, epochs=1, shuffle=False, verbose=0)
    return ref, hist.history["loss"][0]


def assert_trained_like(z, form, history, model, ref, ref_loss):
    """The epoch's loss and the user's model's weights (``ref``: a model or its weights) as
    the reference's; every variable the form holds on the device it is counted for."""
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    ref = ref.get_weights() if hasattr(ref, "get_weights") else ref
    scale = max(np.abs(w).max() for w in ref)
    for w, a, b in zip(model.weights, model.get_weights(), ref, strict=True):
        z.assert_close(a, b, w.path, scale)  # the moving statistics included
    for d, groups in form.held_variables().items():  # everything held where it belongs
        assert {_device(v) for vs in groups.values() for v in vs} <= {d}


ZERO_CASES = [  # model, optimizer, stage, devices, eager (one case traced: tracing costs)
    ("mlp", "adam", 1, 2, True),
    ("mlp", "adam", 2, 2, True),
    ("mlp", "adam", 3, 4, True),
    pytest.param("cnn", "sgd_momentum", 3, 2, True, marks=SLOW),
    pytest.param("transformer", "adam", 3, 2, True, marks=SLOW),
    pytest.param("mlp", "adamw_clipped", 2, 2, True, marks=SLOW),
    pytest.param("mlp", "rmsprop", 1, 2, True, marks=SLOW),
    pytest.param("mlp", "adagrad", 3, 2, False, marks=SLOW),
]


@pytest.mark.parametrize("name,opt,stage,n,eager", ZERO_CASES)
def test_zero_equals_keras_on_one_device(four_devices, keras_zoo, name, opt, stage, n, eager):
    z = keras_zoo
    model = z.MODELS[name]()
    x, y = z.data_for(model)
    reference_optimizer = _optimizer(z, opt)
    exclude = None
    if opt == "adamw_clipped":
        reference_optimizer.exclude_from_weight_decay(var_names=["bias"])
        exclude = ["bias"]
    ref, ref_loss = one_device(z, model, reference_optimizer, x, y, shards=n)
    zero = Zero(model, four_devices[:n], loss="mse", optimizer=_optimizer(z, opt), stage=stage,
                exclude_from_weight_decay=exclude, run_eagerly=eager)
    assert_trained_like(z, zero, zero.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0),
                        model, ref, ref_loss)


OFFLOAD_CASES = [("mlp", "sgd_momentum", False), pytest.param("cnn", "adam", True, marks=SLOW),
                 pytest.param("transformer", "adam", True, marks=SLOW)]


@pytest.mark.parametrize("name,opt,eager", OFFLOAD_CASES)
def test_offload_equals_keras_on_one_device(four_devices, keras_zoo, name, opt, eager):
    z = keras_zoo
    model = z.MODELS[name]()
    x, y = z.data_for(model)
    ref, ref_loss = one_device(z, model, _optimizer(z, opt), x, y, shards=2)
    offload = Offload(model, four_devices[:2], host=four_devices[3], loss="mse",
                      optimizer=_optimizer(z, opt), run_eagerly=eager)
    assert_trained_like(z, offload,
                        offload.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0), model,
                        ref, ref_loss)
    # one optimizer per device's partition, every slot on the host
    assert len(offload.optimizers) == 2
    assert {_device(v) for opt in offload.optimizers for v in opt.variables} == \
        {four_devices[3]}


ACCUMULATION_CASES = [  # form, model, optimizer, devices x micro-batches
    ("accumulating", "mlp", "adam", 2),
    ("keras_accumulation", "mlp", "adam", 2),  # the optimizer's own gradient_accumulation_steps
    ("accumulating", "cnn", "sgd_momentum", 2),
    pytest.param("accumulating", "transformer", "adam", 2, marks=SLOW),
    pytest.param("zero", "mlp", "adam", 4, marks=SLOW),
    pytest.param("offload", "mlp", "adam", 4, marks=SLOW),
]


@pytest.mark.parametrize("form,name,opt,parts", ACCUMULATION_CASES)
def test_accumulation_equals_keras_gradient_accumulation(four_devices, keras_zoo, form, name,
                                                         opt, parts):
    """A step on batch B in k micro-batches (per device) equals Keras's fit on batches of B / k
    with ``gradient_accumulation_steps=k``."""
    z = keras_zoo
    model = z.MODELS[name]()
    x, y = z.data_for(model)
    ref, ref_loss = keras_accumulating_fit(z, name, opt, parts)
    kwargs = {"loss": "mse", "optimizer": _optimizer(z, opt), "run_eagerly": True}
    if form == "accumulating":
        made = Accumulating(model, accumulation_steps=parts, device=four_devices[1], **kwargs)
    elif form == "keras_accumulation":
        mine = kwargs.pop("optimizer")
        mine = mine.__class__.from_config({**mine.get_config(),
                                           "gradient_accumulation_steps": parts})
        made = Accumulating(model, device=four_devices[1], optimizer=mine, **kwargs)
        assert made.accumulation_steps == parts
    elif form == "zero":
        made = Zero(model, four_devices[:2], stage=2, accumulation_steps=parts // 2, **kwargs)
    else:
        made = Offload(model, four_devices[:2], host=four_devices[2],
                       accumulation_steps=parts // 2, **kwargs)
    assert_trained_like(z, made, made.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0),
                        model, ref, ref_loss)


def test_held_bytes_by_hand(four_devices, keras_zoo):
    """The MLP (6-16-16-12-3, float64): P = 627 weights; padded per variable to a multiple of
    4, only the last bias (3 -> 4) grows: 628. Adam keeps 2 slots per weight."""
    model, n, p, padded = keras_zoo.MODELS["mlp"](), 4, 627, 628
    want = {0: (p, padded, 2 * p), 1: (p, padded, 3 * padded // n),
            2: (p, padded // n, 3 * padded // n), 3: (padded // n, padded // n, 2 * padded // n)}
    for stage, counts in want.items():
        zero = Zero(model, four_devices, loss="mse", optimizer="adam", stage=stage)
        for d, row in zero.held_bytes().items():
            assert (row["weights"], row["grads"], row["optimizer"]) == tuple(8 * c
                                                                             for c in counts), d
        for i, opt in enumerate(zero.optimizers):  # every slot on its own device
            assert {_device(v) for v in opt.variables} == {four_devices[i]}
    offload = Offload(model, four_devices[:n - 1], host=four_devices[n - 1], loss="mse",
                      optimizer="adam")
    held = offload.held_bytes()
    # partitioned over 3 devices: each variable padded to a multiple of 3 (16 -> 18 twice,
    # 256 -> 258): 633; the host holds every partition's master weights, gradient buffer and
    # Adam's two slots; a device only its full working weights
    on3 = 96 + 18 + 258 + 18 + 192 + 12 + 36 + 3
    assert held[four_devices[n - 1]] == {"weights": 8 * on3, "grads": 8 * on3,
                                         "optimizer": 16 * on3, "total": 32 * on3}
    assert held[four_devices[0]] == {"weights": 8 * p, "grads": 0, "optimizer": 0,
                                     "total": 8 * p}


@pytest.mark.parametrize("optimizer,match", [
    (keras.optimizers.Lamb(), "optimizer Lamb is not supported .* supported: .*'SGD'"),
    (keras.optimizers.Adam(clipnorm=1.0), "option clipnorm=1.0 is not supported"),
    (keras.optimizers.SGD(use_ema=True), "option use_ema=True"),
    (keras.optimizers.Adam(loss_scale_factor=128.0), "option loss_scale_factor=128.0"),
])
def test_refused_optimizers(four_devices, keras_zoo, optimizer, match):
    model = keras_zoo.MODELS["mlp"]()
    with pytest.raises(ValueError, match=match):
        Zero(model, four_devices[:2], loss="mse", optimizer=optimizer)


def test_bad_input(four_devices, keras_zoo):
    model = keras_zoo.MODELS["mlp"]()
    with pytest.raises(ValueError, match=r"stage must be one of \[0, 1, 2, 3\]"):
        Zero(model, four_devices[:2], loss="mse", optimizer="adam", stage=4)
    with pytest.raises(ValueError, match="accumulation_steps"):
        Zero(model, four_devices[:2], loss="mse", optimizer="adam", accumulation_steps=0)
    # Keras's own gradient_accumulation_steps means the form's accumulation_steps
    keras_way = keras.optimizers.Adam(gradient_accumulation_steps=2)
    assert Zero(model, four_devices[:2], loss="mse", optimizer=keras_way).accumulation_steps == 2
    with pytest.raises(ValueError, match="accumulation_steps=3 but the optimizer's "
                                         "gradient_accumulation_steps=2: give one of them"):
        Zero(model, four_devices[:2], loss="mse", optimizer=keras_way, accumulation_steps=3)
    with pytest.raises(ValueError, match="host .* must not be one of the devices"):
        Offload(model, four_devices[:2], host=four_devices[1], loss="mse", optimizer="adam")
    zero = Zero(model, four_devices[:2], loss="mse", optimizer="adam", accumulation_steps=3,
                run_eagerly=True)
    x, y = keras_zoo.data_for(model, n=8)
    with pytest.raises(ValueError, match="a batch of 8 examples .* multiple of 6"):
        zero.train_step(x, y)
