"""accel.parallel.mirrored.Mirrored: your Keras model, built and compiled under
MirroredStrategy, trained by Keras's fit, against Keras fit of the same model on one device;
BatchNorm per replica vs synchronized, and which one equals one device."""

import keras
import numpy as np
import pytest

from accel.parallel import mirrored


def build_from(model, make_optimizer, synchronized=None, run_eagerly=False):
    """A build function: ``model``'s architecture and weights, compiled with a new optimizer,
    all made in the scope (an optimizer made outside it is refused by Keras)."""
    def build():
        config = model.get_config()
        if synchronized is not None:
            for layer in config["layers"]:
                if layer["class_name"] == "BatchNormalization":
                    layer["config"]["synchronized"] = synchronized
        twin = keras.Sequential.from_config(config)
        twin.set_weights(model.get_weights())
        twin.compile(optimizer=make_optimizer(), loss="mse", jit_compile=False,
                     run_eagerly=run_eagerly)
        return twin
    return build


@pytest.mark.parametrize("name,opt", [("mlp", "adam"),
                                      pytest.param("mlp", "sgd_momentum",
                                                   marks=pytest.mark.slow),
                                      pytest.param("transformer", "adam",
                                                   marks=pytest.mark.slow)])
def test_mirrored_fit_equals_keras_on_one_device(four_devices, keras_zoo, name, opt):
    z = keras_zoo
    model = z.MODELS[name]()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    # the transformer's step eagerly: tracing attention costs more than the 3 steps it runs
    m = mirrored.Mirrored(build_from(model, z.OPTIMIZERS[opt], run_eagerly=name == "transformer"),
                          four_devices[:2])
    assert m.num_replicas == 2
    history = m.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0)
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(m.model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i}", scale)


def test_batchnorm_synchronized_equals_one_device_per_replica_does_not(four_devices, keras_zoo):
    z = keras_zoo
    model = z.MODELS["cnn"]()
    x, y = z.data_for(model)
    ref, _ = z.keras_fit(model, keras.optimizers.SGD(0.05), x, y)
    got = {}
    for sync in (True, False):
        m = mirrored.Mirrored(build_from(model, lambda: keras.optimizers.SGD(0.05), sync),
                              four_devices[:2])
        m.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0)
        got[sync] = m.model.get_weights()
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(got[True], ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"synchronized: weight {i}", scale)
    kernel = np.abs(got[False][0] - ref.get_weights()[0]).max()
    assert kernel > 1e-3 * np.abs(ref.get_weights()[0]).max()  # per replica: another model


def test_build_must_compile_in_the_scope(four_devices, keras_zoo):
    model = keras_zoo.MODELS["mlp"]()
    with pytest.raises(ValueError, match="build must be a function"):
        mirrored.Mirrored(model, four_devices[:2])
    with pytest.raises(ValueError, match="must return a compiled Keras model"):
        mirrored.Mirrored(lambda: keras.Sequential.from_config(model.get_config()),
                          four_devices[:2])
    with pytest.raises(ValueError, match="jit_compile=True"):
        def build():
            twin = keras.Sequential.from_config(model.get_config())
            twin.compile(optimizer="sgd", loss="mse", jit_compile=True)
            return twin
        mirrored.Mirrored(build, four_devices[:2])


def test_per_replica_batchnorm_statistics_diverge(four_devices, keras_zoo):
    """Per-replica BatchNorm under MirroredStrategy: the moving statistics are ON_WRITE
    variables with aggregation NONE, each replica updating its own copy from its own shard
    (nothing keeps them in sync); ``get_weights`` (hence ``save``) returns replica 0's.
    ``synchronized=True`` keeps them equal."""
    import tensorflow as tf

    z = keras_zoo
    model = z.MODELS["cnn"]()
    x, y = z.data_for(model)
    for sync in (False, True):
        m = mirrored.Mirrored(build_from(model, lambda: keras.optimizers.SGD(0.05), sync),
                              four_devices[:2])
        m.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0)
        bn = next(lay for lay in m.model.layers if isinstance(lay, keras.layers.BatchNormalization))
        variable = bn.moving_mean.value
        assert variable.aggregation == tf.VariableAggregation.NONE
        copies = [np.asarray(c) for c in m.strategy.experimental_local_results(variable)]
        assert len(copies) == 2
        if sync:
            np.testing.assert_array_equal(copies[0], copies[1])
        else:
            assert np.abs(copies[0] - copies[1]).max() > 1e-6  # each replica its own shard
        np.testing.assert_array_equal(bn.moving_mean.numpy(), copies[0])
