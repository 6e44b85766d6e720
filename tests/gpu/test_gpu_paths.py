"""The GPU paths of chapters 01-08, run where a GPU is present (`make gpu-check`); skipped
elsewhere. nbval only ever sees the CPU outputs stored in the notebooks, so these tests check what
the same cells do when `devices.setup` finds a GPU: devices named and used, placement and the
copies it implies, soft placement falling back to the CPU, the GPU allocator's peak, and the
parallel recipes equal to one device.

Each check runs in a fresh process (a chapter's `devices.setup` fixes the devices for the life of
a process). TF32 is switched off there: on Ampere and later GPUs TensorFlow runs float32 matmuls
in TF32 by default, about 1e-3 relative precision, which would hide a real difference behind the
rounding. `ACCEL_GPU_CHECK_KIND=cpu` runs the same code on logical CPUs (a dry run of the tests
themselves on a machine without a GPU)."""

import pytest

pytestmark = pytest.mark.gpu


def test_01_devices_are_listed_and_each_computes(run_on):
    out = run_on(2, """
        x = rng.standard_normal((256, 256)).astype(np.float32)
        for name in names:
            with tf.device(name):
                y = tf.matmul(x, x)
            assert y.device.endswith(name.split("device:")[-1]), (y.device, name)
            np.testing.assert_allclose(y.numpy(), x @ x, rtol=1e-4, atol=1e-3)
        print(devices.report())
    """)
    assert f"{run_on.kind.upper()}:1" in out


def test_02_placement_table_and_copies_between_host_and_device(run_on):
    out = run_on(2, """
        from accel.placement import placement_of
        @tf.function
        def step(x):
            with tf.device(names[1]):
                y = tf.matmul(x, x)
            with tf.device("/device:CPU:0"):
                return tf.reduce_sum(y)
        ran = placement_of(step, tf.constant(rng.standard_normal((64, 64)), tf.float32))
        matmul = [r.device for r in ran.rows if r.op_type == "MatMul"]
        assert matmul == [names[1]], (matmul, names)
        assert any(src == names[1] and dst.endswith("CPU:0") for _, src, dst in ran.transfers), \\
            ran.transfers
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_03_an_op_without_a_gpu_kernel_falls_back_to_the_cpu(run_on):
    out = run_on(1, """
        from accel import kernels
        from accel.placement import placement_of, soft_placement
        assert "GPU" in kernels.registered_kernels("MatMul")
        assert "GPU" not in kernels.registered_kernels("StringLength")
        @tf.function
        def lengths(s):
            with tf.device(names[0]):
                return tf.strings.length(s)
        with soft_placement(True):
            ran = placement_of(lengths, tf.constant(["a", "bcd"]))
        assert [r.device for r in ran.rows if r.op_type == "StringLength"] == ["/device:CPU:0"]
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_04_the_allocator_peak_counts_a_step_on_the_device(run_on):
    out = run_on(1, """
        from accel.memory.measure import memory_device, peak_during
        device = memory_device()
        assert device == {KIND.upper()!r} + ":0", device
        a = tf.constant(rng.standard_normal((1024, 1024)), tf.float32)
        with tf.device(names[0]):
            peak, y = peak_during(lambda: tf.matmul(a, a) + 1.0, device)
        assert 4 * 2**20 <= peak < 64 * 2**20, peak
        print("ok")
    """.replace("{KIND.upper()!r}", repr(run_on.kind.upper())))
    assert out.strip().endswith("ok")


def test_05_synchronous_parameter_server_on_the_devices_equals_sgd_on_the_cpu(run_on):
    out = run_on(3, """
        from accel import datasets, models
        from accel.parallel import parameter_server as ps
        from accel.training import squared_error
        x, y, _ = datasets.regression(n=96, features=4, seed=0)
        problem = {"model_fn": models.mlp_apply, "loss_fn": squared_error, "x": x, "y": y,
                   "params": models.mlp_init([4, 8, 1], seed=0)}
        got = ps.train_sync(**problem, workers=names[1:], ps_device=names[0], steps=4,
                            batch_size=8, optimizer=0.05).params
        shards = ps.worker_batches(problem["x"], problem["y"], 2, 8)
        params = [tf.Variable(p) for p in problem["params"]]
        with tf.device("/device:CPU:0"):
            for t in range(4):
                x = np.concatenate([s[t % len(s)][0] for s in shards])
                y = np.concatenate([s[t % len(s)][1] for s in shards])
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(squared_error(y, models.mlp_apply(params, x)))
                for p, g in zip(params, tape.gradient(loss, params)):
                    p.assign_sub(0.05 * g)
        for a, b in zip(got, params):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-6)
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_06_towers_on_the_devices_equal_one_step_on_the_whole_batch(run_on):
    out = run_on(2, """
        from accel import datasets, models
        from accel.parallel import data as dp
        from accel.training import squared_error
        x, y, _ = datasets.regression(128, 8, 1, seed=1)
        towers = dp.make_tower_step(models.mlp_apply, squared_error, models.mlp_init([8, 16, 1]),
                                    0.05, names)
        single = dp.make_single_step(models.mlp_apply, squared_error,
                                     models.mlp_init([8, 16, 1]), 0.05, "/device:CPU:0")
        for k in range(2):
            towers(x[64 * k:64 * (k + 1)], y[64 * k:64 * (k + 1)])
            single(x[64 * k:64 * (k + 1)], y[64 * k:64 * (k + 1)])
        for a, b in zip(towers.variables, single.variables):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
        print("ok")
    """)
    assert out.strip().endswith("ok")
