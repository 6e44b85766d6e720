"""accel.distributed.keras_remote: the Keras forms (pipeline GPipe and 1F1B, tensor parallel,
model parallel, data parallel) run unchanged on devices of two worker tasks of a real cluster,
from a separate client process that connects to it; each equals Keras training the same model
on one device in this process (eager ``fit``, same optimizer class, same data, float64, rtol
1e-5), and the variables, slots and ops sit on the worker tasks the run named."""

import keras
import numpy as np
import pytest

from accel.distributed import cluster as C
from accel.distributed import keras_remote as KR
from accel.parallel.pipeline import device_orders, make_schedule

BATCH, STEPS, RTOL = 16, 3, 1e-5
W0, W1 = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(0.01),
              "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)}
# (run, optimizer): one client process trains them all, one after the other
RUNS = [({"form": "pipeline", "devices": [W0, W1], "schedule": "1f1b", "num_microbatches": 2},
         "adam"),
        ({"form": "pipeline", "devices": [W0, W1], "schedule": "gpipe", "num_microbatches": 2},
         "sgd_momentum"),
        ({"form": "tensor", "devices": [W0, W1],
          "rules": {"l0|l2": "column", "l1|l3": "row"}}, "adam"),
        ({"form": "model", "devices": [W0, W1]}, "adam"),
        ({"form": "data", "devices": [W0, W1]}, "sgd_momentum")]


@keras.saving.register_keras_serializable("accel_tests_remote")
class Residual(keras.layers.Layer):
    """A layer the library does not know: ``x + tanh(x @ w + b)``, rebuilt in the client from
    its config (the client imports this file first: ``imports=[__file__]``)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = keras.layers.Dense(units, activation="tanh", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return x + self.inner(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def mlp():
    """Dense, Residual, Dense | Dense, Dense (a 2-stage split puts the first three on worker 0)."""
    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(n, activation=a, dtype="float64", name=f"l{i}")
             for i, (n, a) in enumerate([(16, "relu"), (16, "tanh"), (12, "relu"), (3, None)])]
    return keras.Sequential([keras.Input((6,), dtype="float64"), dense[0],
                             Residual(16, dtype="float64", name="res"), *dense[1:]])


def keras_on_one_device(model, optimizer, x, y):
    """Keras's own fit, eager, on this process's one device, in order."""
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    ref.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
    history = ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return ref.get_weights(), history.history["loss"]


def task_of(device: str) -> str:
    return device.split("/replica:")[0] + "/task:" + device.split("/task:")[1].split("/")[0]


@pytest.mark.slow  # a cluster and a client process (about 20 s)
def test_keras_forms_on_two_worker_tasks_equal_keras_on_one_device(cluster):
    model = mlp()
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(BATCH * STEPS, 6)), rng.normal(size=(BATCH * STEPS, 3))
    before = [w.copy() for w in model.get_weights()]
    runs = [{**run, "optimizer": OPTIMIZERS[opt]()} for run, opt in RUNS]
    results = KR.fit_on_cluster(cluster, model, x, y, runs, loss="mse", optimizer="adam",
                                batch_size=BATCH, imports=[__file__])
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)  # the caller's model is not touched
    workers = {"/job:worker/task:0", "/job:worker/task:1"}
    for (run, opt), res in zip(RUNS, results, strict=True):
        what = f"{run['form']} {run.get('schedule', '')} {opt}"
        ref_weights, ref_loss = keras_on_one_device(model, OPTIMIZERS[opt](), x, y)
        np.testing.assert_allclose(res.losses, ref_loss, rtol=RTOL, err_msg=what)
        scale = max(np.abs(w).max() for w in ref_weights)
        for i, (a, b) in enumerate(zip(res.weights, ref_weights, strict=True)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale,
                                       err_msg=f"{what}: weight {i}")
        # every working variable and every optimizer slot with a shape lives on a worker task
        # (data parallel: on its variable device, worker 0; its towers run on both)
        held = {"/job:worker/task:0"} if run["form"] == "data" else workers
        var_tasks = [task_of(d) for _, d in res.variables]
        assert set(var_tasks) == held, (what, res.variables)
        slot_tasks = {task_of(d) for p, d in res.slots if not p.endswith(("iteration",
                                                                          "learning_rate"))}
        assert slot_tasks == held, (what, res.slots)
        if run["form"] in ("pipeline", "model"):  # l0, res, l1 on worker 0; l2, l3 on worker 1
            assert var_tasks == ["/job:worker/task:0"] * 6 + ["/job:worker/task:1"] * 4, what
        if run["form"] == "tensor":  # shard i of each split kernel on worker i
            shards = [(p, d) for p, d in res.variables if p.rsplit("/", 1)[-1][:-1] == "kernel_"]
            assert len(shards) == 8, res.variables
            for path, device in shards:
                assert task_of(device) == f"/job:worker/task:{path[-1]}", (path, device)
        if run["form"] == "pipeline":  # each worker ran its stage's tasks in the schedule's order
            expected = device_orders(make_schedule(run["schedule"], 2, 2), 2)
            assert res.device_orders == expected, what
            assert {t[0] for t in res.device_orders[0]} == {0}
        else:  # the placed graphs of the form's steps: matrix products on both worker tasks
            matmul_tasks = {task_of(d) for d, ops in res.op_devices.items() if "MatMul" in ops}
            assert workers <= matmul_tasks, (what, res.op_devices)
            receives = {task_of(d) for d, ops in res.op_devices.items() if "_Recv" in ops}
            assert workers <= receives, (what, res.op_devices)  # tensors crossed between tasks
    assert results[0].device_orders != results[1].device_orders  # 1F1B is not GPipe


@keras.saving.register_keras_serializable("accel_tests_remote")
class PlainResidual(keras.layers.Layer):
    """``x + tanh(x @ w + b)`` whose inner layer takes the global dtype policy (no ``dtype``
    given): float32 in a client that does not take the caller's, and ``x +`` fails there."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = keras.layers.Dense(units, activation="tanh")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return x + self.inner(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@pytest.mark.slow  # one client process on the shared cluster (seconds)
def test_the_client_trains_in_the_callers_floatx_and_dtype_policy(cluster):
    before = keras.config.floatx(), keras.config.dtype_policy().name
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:  # no layer names a dtype: all of them take the caller's float64
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "tanh", name="l0"),
                                  PlainResidual(8, name="res"), keras.layers.Dense(3, name="l1")])
        rng = np.random.default_rng(2)
        x, y = rng.normal(size=(BATCH * STEPS, 6)), rng.normal(size=(BATCH * STEPS, 3))
        (res,) = KR.fit_on_cluster(
            cluster, model, x, y, [{"form": "tensor", "devices": [W0, W1],
                                    "rules": {"l0": "column", "l1": "row"}}],
            loss="mse", optimizer=keras.optimizers.Adam(0.01), batch_size=BATCH,
            imports=[__file__])
        ref_weights, ref_loss = keras_on_one_device(model, keras.optimizers.Adam(0.01), x, y)
    finally:
        keras.config.set_floatx(before[0])
        keras.config.set_dtype_policy(before[1])
    assert (keras.config.floatx(), keras.config.dtype_policy().name) == before
    assert {w.dtype for w in res.weights} == {np.dtype("float64")}
    np.testing.assert_allclose(res.losses, ref_loss, rtol=1e-10)
    scale = max(np.abs(w).max() for w in ref_weights)
    for i, (a, b) in enumerate(zip(res.weights, ref_weights, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * scale, err_msg=f"weight {i}")


def test_a_device_of_a_task_the_cluster_lacks_is_refused_naming_the_tasks():
    spec = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    assert KR.check_cluster_devices([W1, "/cpu:0"], spec) == [
        "/job:worker/task:1/device:CPU:0", "/device:CPU:0"]
    assert KR.worker_devices(spec) == [W0, W1]
    tasks = r"\['/job:ps/task:0', '/job:worker/task:0', '/job:worker/task:1'\]"
    for bad in ("/job:worker/task:2/device:CPU:0", "/job:chief/task:0/device:CPU:0"):
        with pytest.raises(ValueError, match=rf"{bad}.*its tasks: {tasks}"):
            KR.check_cluster_devices([W0, bad], spec)
        with pytest.raises(ValueError, match=bad):
            KR.fit_on_cluster(spec, mlp(), np.zeros((4, 6)), np.zeros((4, 3)),
                              [{"form": "pipeline", "devices": [W0, bad],
                                "num_microbatches": 2}], loss="mse", optimizer="adam",
                              batch_size=4)


def test_a_cluster_nobody_serves_is_a_connection_error_naming_the_address():
    spec = C.make_cluster(ps=0, workers=2)  # free ports: nothing listens there
    with pytest.raises(ConnectionError, match=f"worker:1 at {spec['worker'][1]}"):
        KR.fit_on_cluster(spec, mlp(), np.zeros((4, 6)), np.zeros((4, 3)),
                          [{"form": "data", "devices": KR.worker_devices(spec)}], loss="mse",
                          optimizer="adam", batch_size=4, connect_timeout=1.0)


def test_towers_refuse_variables_on_another_task_than_the_variable_device():
    from accel.parallel.data import make_tower_step

    with pytest.raises(ValueError, match="not on the variable device '/job:worker/task:0"):
        make_tower_step(None, keras.losses.MeanSquaredError(), mlp(), 0.1, [W0, W1])


# the rest of the registry's forms: the interleaved pipeline, a hybrid of two replicas, ZeRO
# stages 1 and 3, offload to the client's own CPU, accumulation on one worker
C0 = "/job:localhost/replica:0/task:0/device:CPU:0"
MORE_RUNS = [
    {"form": "pipeline", "devices": [W0, W1], "schedule": "interleaved", "num_chunks": 2,
     "num_microbatches": 2},
    {"form": "model", "replicas": [[W0], [W1]]},
    {"form": "zero", "devices": [W0, W1], "stage": 1},
    {"form": "zero", "devices": [W0, W1], "stage": 3},
    {"form": "offload", "devices": [W0, W1], "host": C0},
    {"form": "accumulate", "devices": [W0], "accumulation_steps": 2},
]


@pytest.mark.slow  # one client process on the shared cluster (seconds)
def test_every_other_form_runs_across_processes(cluster):
    """fit_on_cluster goes through accel.parallel.forms: every form of the registry trains on
    the worker tasks and equals Keras's fit on one device (Adam; no BatchNorm, so replicas and
    micro-batches change nothing); its working variables live where the run put them."""
    model = mlp()
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(BATCH * STEPS, 6)), rng.normal(size=(BATCH * STEPS, 3))
    results = KR.fit_on_cluster(cluster, model, x, y, MORE_RUNS, loss="mse",
                                optimizer=OPTIMIZERS["adam"](), batch_size=BATCH,
                                imports=[__file__])
    ref_weights, ref_loss = keras_on_one_device(model, OPTIMIZERS["adam"](), x, y)
    scale = max(np.abs(w).max() for w in ref_weights)
    for run, res in zip(MORE_RUNS, results, strict=True):
        what = f"{run['form']} {run.get('stage', run.get('schedule', ''))}"
        np.testing.assert_allclose(res.losses, ref_loss, rtol=RTOL, err_msg=what)
        for i, (a, b) in enumerate(zip(res.weights, ref_weights, strict=True)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale,
                                       err_msg=f"{what}: weight {i}")
        tasks = {task_of(d) for _, d in res.variables}
        want = {"/job:worker/task:0"} if run["form"] == "accumulate" else {
            "/job:worker/task:0", "/job:worker/task:1"}
        if run["form"] == "offload":  # the master weights on the client's CPU
            want = want | {"/job:localhost/task:0"}
        assert tasks == want, (what, res.variables)
