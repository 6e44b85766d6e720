"""accel.placement (and accel.kernels through it): executed placement, logging, soft placement,
device functions and the kernel registry."""

import numpy as np
import pytest
import tensorflow as tf

from accel import placement

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
CPUS = ["/CPU:0", "/CPU:1", "/CPU:2", "/CPU:3"]
REAL = ("_Send", "_Recv", "_Arg", "_Retval")


def _pinned_chain(x):
    """One op pinned to each of the four devices (a binary op between the sines: Grappler fuses
    a chain of unary ops into one _UnaryOpsComposition node)."""
    for i, dev in enumerate(CPUS):
        with tf.device(dev):
            x = tf.add(tf.math.sin(x), 1.0, name=f"sin{i}")
    return x


def _expected(values):
    out = np.asarray(values)
    for _ in CPUS:
        out = np.sin(out) + 1.0
    return out


# ----------------------------------------------------------------------------- placement_of
@pytest.mark.skipif(HAS_GPU, reason="the course's CPU layout")
def test_placement_of_tf_function_returns_the_pinned_devices():
    x = tf.constant([0.1, 0.2])
    table = placement.placement_of(tf.function(_pinned_chain), x)
    for i in range(4):
        assert table.device_of(f"sin{i}") == f"/device:CPU:{i}"
        assert table.device_of(f"sin{i}") == placement.short_device(
            f"/job:localhost/replica:0/task:0/device:CPU:{i}")
    assert table.devices() == [f"/device:CPU:{i}" for i in range(4)]
    assert len(table.transfers) == 3  # one copy between consecutive devices
    np.testing.assert_allclose(table.result.numpy(), _expected([0.1, 0.2]), rtol=1e-6)


@pytest.mark.skipif(HAS_GPU, reason="the course's CPU layout")
def test_placement_of_tf1_session_returns_the_pinned_devices():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        y = _pinned_chain(x)
    with tf.compat.v1.Session(graph=g, config=placement.session_config()) as sess:
        table = placement.placement_of(y, session=sess, feed_dict={x: [0.1, 0.2]})
    assert [table.device_of(f"sin{i}") for i in range(4)] == [f"/device:CPU:{i}" for i in range(4)]
    assert [table.rows[[r.name for r in table].index(f"sin{i}")].requested
            for i in range(4)] == [f"/device:CPU:{i}" for i in range(4)]
    np.testing.assert_allclose(table.result, _expected([0.1, 0.2]), rtol=1e-6)


def test_placement_of_an_already_traced_function_ignores_earlier_eager_ops():
    f = tf.function(lambda x: x * 3.0)
    x = tf.ones((2,))
    f(x)
    placement.placement_of(f, x)
    with tf.device("/cpu:3"):
        tf.math.cos(x)  # an eager op between two runs must not leak into the next table
    table = placement.placement_of(f, x)
    assert sorted(r.op_type for r in table) == ["Const", "Mul", "_Arg", "_Retval"]
    np.testing.assert_allclose(table.result.numpy(), [3.0, 3.0])


def test_placement_table_queries():
    x = tf.constant([0.1, 0.2])
    table = placement.placement_of(_pinned_chain, x)
    assert [r.name for r in table.ops_on("/cpu:1") if r.op_type == "AddV2"] == ["sin1"]
    assert table.ops_on("/device:CPU:1") == table.ops_on("/CPU:1")
    assert sum(table.counts().values()) == len(table)
    real = table.without(*REAL)
    assert {r.op_type for r in real} == {"Sin", "AddV2", "Const"}
    lines = real.format(requested=True).splitlines()
    assert lines[0].split() == ["op", "type", "device", "requested"]
    assert len(lines) == len(real) + 1
    with pytest.raises(KeyError, match="no op named 'nope'"):
        table.device_of("nope")
    counted = real.count_table(["AddV2", "Sin"]).splitlines()
    assert counted[0].split() == ["device", "AddV2", "Sin"]
    assert len(counted) == len(real.devices()) + 1
    per_device = {line.split()[0]: [int(n) for n in line.split()[1:]] for line in counted[1:]}
    for dev, (adds, sins) in per_device.items():
        assert adds == sum(r.op_type == "AddV2" for r in real.ops_on(dev))
        assert sins == sum(r.op_type == "Sin" for r in real.ops_on(dev))
    with pytest.raises(ValueError, match="op_types is empty"):
        real.count_table([])


def test_placement_of_keeps_the_functions_options():
    """A tf.function's own options (input_signature, jit_compile) survive placement_of."""
    sig = tf.function(lambda x: x * 2.0, input_signature=[tf.TensorSpec([None], tf.float32)])
    table = placement.placement_of(sig, tf.ones((3,)))
    np.testing.assert_allclose(table.result.numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(TypeError):  # the signature still refuses an int tensor
        placement.placement_of(sig, tf.ones((3,), tf.int32))
    # jit_compile=True is kept: XLA runs the function as one program, which leaves no
    # partition graph behind (a re-wrapped plain function would list its Sin and Mul)
    xla = tf.function(lambda x: tf.math.sin(x) * 2.0, jit_compile=True)
    table = placement.placement_of(xla, tf.ones((3,)))
    assert table.rows == []
    np.testing.assert_allclose(table.result.numpy(), [2 * np.sin(1.0)] * 3, rtol=1e-6)
    plain = {r.op_type for r in placement.placement_of(lambda x: tf.math.sin(x) * 2.0,
                                                       tf.ones((3,)))}
    assert "Sin" in plain and not any("Xla" in t for t in plain)


def test_sends_in_counts_host_sends_as_sends():
    """A ``_HostSend`` (a tensor in host memory on a GPU) is a copy like a ``_Send``: the same
    node with either op type gives the same Transfer (checked on a real run's partition graphs,
    since this machine makes no _HostSend)."""
    table = placement.placement_of(_pinned_chain, tf.constant([0.1, 0.2]))
    graphs = []
    for gd in table.graphs:
        copy = type(gd)()
        copy.CopyFrom(gd)
        for node in copy.node:
            if node.op == "_Send":
                node.op = "_HostSend"
        graphs.append(copy)
    assert placement.sends_in(graphs, table.traced) == table.sends
    assert len(table.sends) == 3


def test_placement_of_rejects_bad_targets():
    with pytest.raises(ValueError, match="target must be a callable or tf.function .* got int"):
        placement.placement_of(42)
    with tf.compat.v1.Session(graph=tf.Graph(), config=placement.session_config()) as sess:
        with pytest.raises(ValueError, match=r"feeds as feed_dict, not positional.* \(got 1 args"):
            placement.placement_of([], 1, session=sess)


# ----------------------------------------------------------------------------- session_config
def test_session_config_sees_the_logical_devices(four_devices):
    config = placement.session_config(log_device_placement=True, allow_soft_placement=False)
    assert config.log_device_placement and not config.allow_soft_placement
    with tf.compat.v1.Session(graph=tf.Graph(), config=config) as sess:
        names = [d.name for d in sess.list_devices()]
    assert [placement.short_device(n) for n in names] == four_devices
    with pytest.raises(ValueError, match="no field 'bogus'"):
        placement.session_config(bogus=1)


# ----------------------------------------------------------------------------- log_placement
def _tf1_graph():
    g = tf.Graph()
    with g.as_default():
        with tf.device("/cpu:0"):
            a = tf.compat.v1.placeholder(tf.float32, [2], name="a")
        with tf.device("/cpu:2"):
            c = tf.add(a, a, name="c")
    return g, a, c


@pytest.mark.slow
def test_tf2_log_switch_works_only_before_the_eager_context_starts():
    """What chapter 02 and log_placement's docstring say: set before anything starts the context,
    the placer logs the Sin; set after a device listing (which starts the context), nothing."""
    from accel import procs

    child = """import tensorflow as tf
{first}
tf.debugging.set_log_device_placement(True)
tf.function(lambda v: tf.sin(v))(tf.constant(1.0))"""
    seen = {first: [ln for ln in procs.run_python(child.format(first=first)).splitlines()
                    if "(Sin)" in ln]
            for first in ("", "tf.config.list_logical_devices()")}
    assert len(seen[""]) == 1 and seen[""][0].startswith("Sin: (Sin): /job:localhost/")
    assert seen["tf.config.list_logical_devices()"] == []


def test_log_placement_turns_the_tf1_log_into_rows():
    g, a, c = _tf1_graph()
    config = placement.session_config(log_device_placement=True)
    with placement.log_placement() as log, tf.compat.v1.Session(graph=g, config=config) as sess:
        sess.run(c, {a: [1.0, 2.0]})
    assert {r.name: r.device for r in log.rows} == {"a": "/device:CPU:0", "c": "/device:CPU:2"}
    assert "c: (AddV2)" in log.text
    assert log.format().splitlines()[0].split() == ["op", "type", "device"]


@pytest.mark.skipif(HAS_GPU, reason="checks the fallback to CPU")
def test_log_placement_leaves_soft_placement_working():
    # toggling TF2's log switch on a running context disables eager soft placement in TF 2.21
    with placement.log_placement():
        pass
    with tf.device("/gpu:0"):
        y = tf.math.sin(tf.ones(2))
    assert y.device.endswith("CPU:0")


def test_log_placement_restores_output_when_the_block_raises(capfd):
    with pytest.raises(ZeroDivisionError):
        with placement.log_placement():
            1 / 0  # noqa: B018
    print("visible again")
    assert "visible again" in capfd.readouterr().out


# ----------------------------------------------------------------------------- soft placement
def test_soft_placement_switches_and_restores():
    assert tf.config.get_soft_device_placement()
    with placement.soft_placement(False):
        assert not tf.config.get_soft_device_placement()
    assert tf.config.get_soft_device_placement()
    with pytest.raises(RuntimeError):
        with placement.soft_placement(False):
            raise RuntimeError("inside")
    assert tf.config.get_soft_device_placement()
    with pytest.raises(ValueError, match="enabled must be True or False, got 'no'"):
        with placement.soft_placement("no"):
            pass


@pytest.mark.skipif(HAS_GPU, reason="needs a machine without GPUs")
def test_strict_placement_fails_and_soft_placement_falls_back():
    x = tf.ones(2)
    with placement.soft_placement(False):
        with pytest.raises(tf.errors.InvalidArgumentError):
            with tf.device("/gpu:0"):
                tf.math.sin(x)
    g = tf.Graph()
    with g.as_default():
        with tf.device("/gpu:0"):
            v = tf.compat.v1.Variable(0, name="a_gpu", use_resource=False)
    strict = placement.session_config(allow_soft_placement=False)
    with tf.compat.v1.Session(graph=g, config=strict) as sess:
        with pytest.raises(tf.errors.InvalidArgumentError, match="Cannot assign a device"):
            sess.run(v.initializer)
    with tf.compat.v1.Session(graph=g, config=placement.session_config()) as sess:
        table = placement.placement_of(v.initializer, session=sess)
    assert table.device_of("a_gpu") == "/device:CPU:0"
    assert next(r for r in table if r.name == "a_gpu").requested == "/device:GPU:0"


# ----------------------------------------------------------------------------- device functions
def test_variables_on_places_variables_and_the_rest():
    g = tf.Graph()
    with g.as_default(), tf.compat.v1.device(placement.variables_on("/cpu:0", "/cpu:3")):
        v = tf.compat.v1.Variable(3.0, name="v", use_resource=False)
        p = tf.compat.v1.placeholder(tf.float32, [], name="p")
        y = tf.add(v, p, name="y")
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=g, config=placement.session_config()) as sess:
        sess.run(init)
        table = placement.placement_of(y, session=sess, feed_dict={p: 4.0})
    assert table.result == 7.0
    assert table.device_of("v") == "/device:CPU:0"
    assert table.device_of("y") == "/device:CPU:3"
    assert table.device_of("v/read") == "/device:CPU:0"  # colocation beats the device function


def test_variables_on_decides_as_a_hand_written_device_function():
    # chapter 02's device function, written out: variables on CPU:0, every other op on CPU:3
    def by_hand(op):
        return "/cpu:0" if op.type in ("VariableV2", "VarHandleOp") else "/cpu:3"

    g = tf.Graph()
    with g.as_default(), tf.compat.v1.device(by_hand):
        v = tf.compat.v1.Variable(3.0, name="v", use_resource=False)
        r = tf.compat.v1.Variable(1.0, name="r")  # a resource variable: VarHandleOp
        p = tf.compat.v1.placeholder(tf.float32, [], name="p")
        tf.add(v + r, p, name="y")
    helper = placement.variables_on("/cpu:0", "/cpu:3")
    ops = g.get_operations()
    assert {op.type for op in ops} >= {"VariableV2", "VarHandleOp", "AddV2", "Placeholder"}
    assert [helper(op) for op in ops] == [by_hand(op) for op in ops]


def test_by_op_type_inside_tf_function():
    route = placement.by_op_type({"MatMul": "/cpu:1"}, default="/cpu:2")

    def layer(x, w):
        with tf.compat.v1.device(route):
            return tf.nn.relu(tf.matmul(x, w))

    x, w = tf.ones((2, 3)), tf.ones((3, 4))
    table = placement.placement_of(layer, x, w)
    assert table.device_of("MatMul") == "/device:CPU:1"
    assert table.device_of("Relu") == "/device:CPU:2"
    np.testing.assert_allclose(table.result.numpy(), np.full((2, 4), 3.0))


def test_device_functions_validate_names_early():
    with pytest.raises(ValueError, match="gpu:x"):
        placement.by_op_type({"MatMul": "/gpu:x"}, default="/cpu:0")
    with pytest.raises(ValueError, match="task:-1"):
        placement.variables_on("/job:ps/task:-1", "/cpu:0")
    with pytest.raises(RuntimeError, match="does not support functions"):
        with tf.device(placement.variables_on("/cpu:0", "/cpu:1")):
            pass


def test_short_error_is_reproducible():
    g = tf.Graph()
    with g.as_default(), tf.device("/cpu:1"):
        m = tf.constant([[1, 2], [3, 4]], dtype=tf.uint8)
        product = tf.linalg.matmul(m, m, name="product")
    strict = placement.session_config(allow_soft_placement=False)
    with tf.compat.v1.Session(graph=g, config=strict) as sess:
        with pytest.raises(tf.errors.InvalidArgumentError) as err:
            sess.run(product)
    text = placement.short_error(err.value)
    assert text.startswith("InvalidArgumentError: No OpKernel was registered")
    assert "with these attrs: [T=DT_UINT8, grad_a=false, grad_b=false" in text
    assert "Detected at node" not in text and "File " not in text
