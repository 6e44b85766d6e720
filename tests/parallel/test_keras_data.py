"""accel.parallel.data.DataParallel (towers by hand) on Keras models the library did not build,
against Keras training the same model on one device: losses, gradients, weights after several
steps; variables and optimizer slots on the variable device; BatchNorm per tower shown."""

import numpy as np
import pytest

from accel.parallel import data as dp
from accel.parallel import keras_model as km
from accel.placement import short_device

SLOW = pytest.mark.slow  # several seconds (attention traced): make test, not make quick
CASES = [("mlp", "adam", 2), pytest.param("mlp", "sgd_momentum", 4, marks=SLOW),
         pytest.param("transformer", "adam", 2, marks=SLOW)]


@pytest.mark.parametrize("name,opt,n", CASES)
def test_towers_equal_keras_on_one_device(four_devices, keras_zoo, name, opt, n):
    z = keras_zoo
    model = z.MODELS[name]()
    x, y = z.data_for(model)
    ref, ref_loss = z.keras_fit(model, z.OPTIMIZERS[opt](), x, y)
    towers = dp.DataParallel(model, four_devices[:n], loss="mse", optimizer=z.OPTIMIZERS[opt](),
                             variable_device=four_devices[n - 1])
    history = towers.fit(x, y, batch_size=z.BATCH, shuffle=False, verbose=0)
    z.assert_close(history.history["loss"][0], ref_loss, "epoch loss")
    scale = max(np.abs(w).max() for w in ref.get_weights())
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights(), strict=True)):
        z.assert_close(a, b, f"weight {i}", scale)
    assert km.variable_devices([towers.copy]) == {four_devices[n - 1]}
    slots = {short_device(v.value.device) for v in towers.optimizer.variables
             if v.path.endswith("_momentum")}
    assert slots == {four_devices[n - 1]}


def test_batchnorm_is_per_tower(four_devices, keras_zoo):
    """Each tower normalises its own shard: the first step's update equals one device running
    the shards separately (gradients averaged), not the whole batch at once."""
    z = keras_zoo
    model = z.MODELS["cnn"]()
    x, y = z.data_for(model)
    before = [w.numpy().copy() for w in model.trainable_weights]
    towers = dp.DataParallel(model, four_devices[:2], loss="mse", optimizer="sgd")
    loss = towers.train_step(x[:z.BATCH], y[:z.BATCH])["loss"]
    lr = towers.optimizer.learning_rate.numpy()
    got = z.flat([(b - a.numpy()) / lr for a, b in zip(towers.copy.trainable_weights, before,
                                                       strict=True)])
    loss_shards, per_shard = z.first_gradients(model, x, y, microbatches=2)
    _, whole = z.first_gradients(model, x, y, microbatches=1)
    z.assert_close(loss, loss_shards, "loss")
    z.assert_close(got, z.flat(per_shard), "update / learning rate")
    assert np.abs(got - z.flat(whole)).max() > 1e-3 * np.abs(z.flat(whole)).max()


def test_bad_input(four_devices, keras_zoo):
    model = keras_zoo.MODELS["mlp"]()
    with pytest.raises(ValueError, match="devices is empty"):
        dp.DataParallel(model, [], loss="mse", optimizer="adam")
    towers = dp.DataParallel(model, four_devices[:4], loss="mse", optimizer="adam")
    x, y = keras_zoo.data_for(model, n=36)
    with pytest.raises(ValueError, match=r"36 examples in batches of 18: every batch \(the "
                                         r"last has 18\) must split into 4 equal parts"):
        towers.fit(x, y, batch_size=18)
