"""accel.profile: step-stats timelines and copies against the partition graphs and hand-written
tables, profiler traces against the ops that ran, and TF_CPP_MIN_LOG_LEVEL against TensorFlow
started at each level."""

import functools
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from accel import placement, procs, profile


def two_branch_step():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 64], name="x")
        with tf.device("/cpu:0"):
            a = tf.matmul(x, x, name="a")
        with tf.device("/cpu:1"):
            b = tf.matmul(x, x, name="b")
        with tf.device("/cpu:0"):
            total = tf.add(a, b, name="total")
    feed = {x: np.eye(64, dtype=np.float32)}
    with tf.compat.v1.Session(graph=g, config=placement.session_config()) as sess:
        result, meta = profile.traced_run(sess, total, feed)
    return result, meta


def test_step_intervals_and_copies_match_a_hand_written_table(four_devices):
    result, meta = two_branch_step()
    np.testing.assert_allclose(result, 2 * np.eye(64), rtol=1e-6)
    ops = profile.step_intervals(meta, skip=("NoOp", "_Retval"))
    assert sorted((i.lane, i.name, i.op_type) for i in ops) == [
        ("/device:CPU:0", "_arg_x_0_0", "_Arg"), ("/device:CPU:0", "a", "MatMul"),
        ("/device:CPU:0", "total", "AddV2"), ("/device:CPU:1", "b", "MatMul")]
    assert min(i.start for i in ops) == 0.0 and all(i.end >= i.start for i in ops)
    copies = profile.copy_intervals(meta, ops)
    assert sorted((c.name, c.lane) for c in copies) == [
        ("_arg_x_0_0", "copy -> /device:CPU:1"), ("b", "copy -> /device:CPU:0")]
    at = {i.name: i for i in ops}
    assert at["total"].start >= max(at["a"].end, at["b"].end)  # the synchronisation point
    by_name = {c.name: c for c in copies}
    assert by_name["b"].start == at["b"].end and by_name["b"].end == at["total"].start


def test_step_intervals_needs_a_traced_run():
    with pytest.raises(ValueError, match="no step stats: run with trace_level=FULL_TRACE"):
        profile.step_intervals(tf.compat.v1.RunMetadata())


def _two_branch_step(add_on: str | None = None):
    """Two matmuls on /cpu:0, one on /cpu:1, and their sum (on ``add_on``, or unpinned)."""
    @tf.function
    def step(x):
        with tf.device("/cpu:0"):
            a = tf.matmul(tf.matmul(x, x), x)
        with tf.device("/cpu:1"):
            b = tf.matmul(x, x)
        if add_on is None:
            return a + b
        with tf.device(add_on):
            return a + b

    return step


def test_profiler_trace_counts_the_ops_that_ran(four_devices, tmp_path):
    step = _two_branch_step()
    xs = tf.ones((32, 32))
    ran = placement.placement_of(step, xs)
    step(xs)
    path = profile.profile_trace(lambda: step(xs), str(tmp_path))
    assert path.endswith(".xplane.pb")
    rows = dict((n, c) for n, c, _ in profile.summarize_trace(
        profile.trace_events(path), names=["MatMul", "AddV2", "_Send"]))
    expected = {t: sum(r.op_type == t for r in ran) for t in ("MatMul", "AddV2", "_Send")}
    assert rows == expected == {"MatMul": 3, "AddV2": 1, "_Send": 2}


def test_read_trace_reads_the_trace_then_removes_its_folder(four_devices, tmp_path,
                                                            monkeypatch):
    """Without a logdir the trace goes to a temporary folder that is gone once read; with one
    it stays there. The ops read back are those ``placement_of`` lists for the function."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where TemporaryDirectory goes
    step = _two_branch_step()
    xs = tf.ones((32, 32))
    step(xs)
    seen = []

    def read(path):
        seen.append(path)
        return [r.type for r in profile.op_runs(path)]

    types = profile.read_trace(lambda: step(xs), read)
    assert types.count("MatMul") == sum(r.op_type == "MatMul"
                                        for r in placement.placement_of(step, xs)) == 3
    assert seen[0].startswith(str(tmp_path)) and not os.path.exists(seen[0])
    assert os.listdir(tmp_path) == []
    kept = str(tmp_path / "kept")
    profile.read_trace(lambda: step(xs), read, kept)
    assert seen[1].startswith(kept) and os.path.exists(seen[1])


def test_profile_trace_rejects_a_non_callable(tmp_path):
    with pytest.raises(ValueError, match="fn must be a callable taking no arguments, got int"):
        profile.profile_trace(3, str(tmp_path))


def test_summarize_trace_totals_by_name_on_one_plane():
    ev = [profile.TraceEvent("/host:CPU", "t1", "MatMul", 0.0, 2.0),
          profile.TraceEvent("/host:CPU", "t2", "MatMul", 1.0, 3.0),
          profile.TraceEvent("/host:CPU", "t1", "AddV2", 5.0, 0.5),
          profile.TraceEvent("/device:GPU:0", "s", "MatMul", 0.0, 9.0)]
    assert profile.summarize_trace(ev) == [("MatMul", 2, 5.0), ("AddV2", 1, 0.5)]
    assert profile.summarize_trace(ev, top=1) == [("MatMul", 2, 5.0)]
    assert profile.summarize_trace(ev, plane="/device:GPU:0") == [("MatMul", 1, 9.0)]
    assert profile.format_summary([("MatMul", 2, 5.0)]).splitlines() == [
        "name    count  total ms", "MatMul      2     5.000"]
    with pytest.raises(ValueError, match="top must be"):
        profile.summarize_trace(ev, top=0)


LINES = [
    "I0000 00:00:1795446115.628510   10730 placer.cc:162] Sin: (Sin): /job:localhost/...",
    "W0000 00:00:1795446115.628510   10730 x.cc:1] a warning",
    "E0000 00:00:1795446115.458872   10730 cuda_platform.cc:52] failed call to cuInit: ...",
    "Sin: (Sin): /job:localhost/replica:0/task:0/device:CPU:0",
]


def test_log_severity_and_levels_match_a_hand_written_table():
    assert [profile.log_severity(ln) for ln in LINES] == ["INFO", "WARNING", "ERROR", None]
    assert [len(profile.visible_at_level(LINES, lv)) for lv in range(4)] == [4, 3, 2, 1]
    assert profile.visible_at_level(LINES, 3) == [LINES[3]]
    with pytest.raises(ValueError, match="level must be one of 0, 1, 2, 3"):
        profile.visible_at_level(LINES, 4)


CHILD = """import os
os.dup2(1, 2)
import tensorflow as tf
tf.debugging.set_log_device_placement(True)
tf.function(lambda v: tf.sin(v) * 2.0)(tf.constant([1.0, 2.0]))"""


@functools.cache
def logged_at(level: int) -> list[tuple[str, str]]:
    """(severity, message) of the log lines the child prints at this TF_CPP_MIN_LOG_LEVEL, in a
    fresh interpreter (the level is read at import). Level 0 is each test's reference: run once."""
    out = procs.run_python(CHILD, env={"TF_CPP_MIN_LOG_LEVEL": str(level)},
                           quiet_tensorflow=False)
    return sorted({(str(profile.log_severity(ln)), ln.split("] ", 1)[-1])
                   for ln in out.splitlines()
                   if "(Sin)" in ln or "Executing op" in ln or "cuInit" in ln})


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 3])
def test_tf_cpp_min_log_level_hides_what_visible_at_level_predicts(level):
    everything = logged_at(0)
    assert any(sev == "INFO" and msg.startswith("Executing op") for sev, msg in everything)
    hidden = ("INFO", "WARNING", "ERROR")[:level]
    assert logged_at(level) == [(s, m) for s, m in everything if s not in hidden]


def _node(name, op, device, inputs=(), tensor=None):
    node = tf.compat.v1.NodeDef(name=name, op=op, device=device, input=list(inputs))
    if tensor is not None:
        node.attr["tensor_name"].s = tensor.encode()
    return node


def _two_device_table():
    """A hand-built table: `a` on CPU:0 is sent to CPU:1, where `c` reads it."""
    cpu0, cpu1 = "/job:localhost/replica:0/task:0/device:CPU:0", \
        "/job:localhost/replica:0/task:0/device:CPU:1"
    g0, g1 = tf.compat.v1.GraphDef(), tf.compat.v1.GraphDef()
    g0.node.extend([_node("a", "MatMul", cpu0), _node("a/_1", "_Send", cpu0, ["a"], "edge_1_a")])
    g1.node.extend([_node("a/_2", "_Recv", cpu1, tensor="edge_1_a"),
                    _node("c", "AddV2", cpu1, ["a/_2", "y"])])
    rows = [placement.OpPlacement(n.name, n.op, placement.short_device(n.device))
            for g in (g0, g1) for n in g.node]
    return placement.Placement(rows, graphs=[g0, g1])


def test_device_timeline_on_a_hand_built_trace_and_table():
    table = _two_device_table()
    runs = [profile.OpRun("ThreadpoolListener:", "Record", 0.0, 0.0),  # not an op: ignored
            profile.OpRun("a", "MatMul", 1.0, 3.0), profile.OpRun("c", "AddV2", 5.0, 6.0)]
    ops, copies = profile.device_timeline(runs, table)
    assert ops == [profile.Interval("/device:CPU:0", 0.0, 2.0, "a", "MatMul"),
                   profile.Interval("/device:CPU:1", 4.0, 5.0, "c", "AddV2")]
    # no event for the send: the copy lane starts where its producer ended
    assert copies == [profile.Interval("copy -> /device:CPU:1", 2.0, 4.0, "a", "_Send/_Recv")]
    runs.append(profile.OpRun("a/_1", "_Send", 3.5, 3.6))  # with the send's own event
    ops, copies = profile.device_timeline(runs, table)
    assert [i.name for i in ops] == ["a", "a/_1", "c"]
    assert copies == [profile.Interval("copy -> /device:CPU:1", 2.5, 4.0, "a", "_Send/_Recv")]


def test_device_timeline_bad_arguments():
    with pytest.raises(ValueError, match="table must be an accel.placement.Placement"):
        profile.device_timeline([], {"a": "/cpu:0"})
    with pytest.raises(ValueError, match="no op of the trace is in the table"):
        profile.device_timeline([profile.OpRun("other", "Sin", 0.0, 1.0)], _two_device_table())


def test_device_timeline_of_a_traced_function_matches_its_placement(four_devices, tmp_path):
    step = _two_branch_step("/cpu:0")
    xs = tf.ones((64, 64))
    table = placement.placement_of(step, xs)
    step(xs)  # traced before the profile
    runs = profile.op_runs(profile.profile_trace(lambda: step(xs), str(tmp_path)))
    ops, copies = profile.device_timeline(runs, table)
    # a hand-written table of where each op ran and which tensors crossed
    assert sorted((i.lane, i.op_type) for i in ops if i.op_type != "_Send") == [
        ("/device:CPU:0", "AddV2"), ("/device:CPU:0", "MatMul"), ("/device:CPU:0", "MatMul"),
        ("/device:CPU:1", "MatMul")]
    assert sorted((c.name, c.lane) for c in copies) == [
        ("MatMul_2", "copy -> /device:CPU:0"), ("x", "copy -> /device:CPU:1")]
    at = {i.name: i for i in ops}
    assert at["add"].start >= max(at["MatMul_1"].end, at["MatMul_2"].end)
    back = next(c for c in copies if c.name == "MatMul_2")
    assert back.start == at["MatMul_2/_3"].start and back.end == at["add"].start


def test_memory_timeline_records_a_known_allocation_and_its_free(tmp_path):
    """A 512 x 512 float32 product is 1 MiB: the trace shows the allocator handing it to the op
    named ``product``, then taking 1 MiB back once the sum has read it (the BFC allocator
    records both: conftest sets TF_CPU_ALLOCATOR_USE_BFC=true)."""
    @tf.function
    def step(x):
        return tf.reduce_sum(tf.matmul(x, x, name="product"))

    xs = tf.ones((512, 512))
    step(xs)  # traced before the profile
    events = profile.memory_timeline(profile.profile_trace(lambda: step(xs), str(tmp_path)))
    assert events and events[0].time == 0.0
    assert all(a.time <= b.time for a, b in zip(events, events[1:], strict=False))
    made = [e for e in events if e.op == "product"]
    assert [e.requested for e in made] == [2**20] and made[0].change >= 2**20
    assert made[0].allocator == "bfc_cpu_allocator_for_gpu"
    later = events[events.index(made[0]) + 1:]
    assert any(e.requested == -2**20 and e.op == "" for e in later)
    assert profile.memory_timeline(profile.profile_trace(lambda: None, str(tmp_path / "idle"))) \
        == []
