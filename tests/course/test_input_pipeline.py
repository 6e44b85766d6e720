"""accel.course.input_pipeline: the input-bound rule against a hand-written table, what the
tf.data options do (counted, and read from the pipeline's graph), the timing harness's logic,
and the exercises (no timing thresholds)."""

import numpy as np
import pytest
import tensorflow as tf

from accel import datasets
from accel.course import input_pipeline as ip


@pytest.mark.parametrize("input_s,compute_s,expected", [
    (0.080, 0.030, "input-bound"),
    (0.030, 0.080, "compute-bound"),
    (0.030, 0.030, "compute-bound"),  # a tie: the devices never wait
    (0.0, 0.001, "compute-bound"),
])
def test_verdict_table(input_s, compute_s, expected):
    assert ip.verdict(input_s, compute_s) == expected


def test_verdict_rejects_negative_times():
    with pytest.raises(ValueError, match="input_s must be"):
        ip.verdict(-1.0, 0.1)


def test_pipelines_keep_order_and_count_map_calls():
    x, y, _ = datasets.regression(256, 8, seed=0)
    feeds = ip.pipelines(x, y, 64, 0.0)
    assert list(feeds) == ["map", "map + prefetch", "parallel map (4) + prefetch",
                           "map + cache + prefetch"]
    for ds in feeds.values():
        for _ in range(2):  # epochs: order kept, nothing lost
            np.testing.assert_array_equal(np.concatenate([xb.numpy() for xb, _ in ds]), x)
    calls = []
    base = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    for cache, expected in ((False, 3 * 4), (True, 4)):
        calls.clear()
        ds = base.map(ip.decode_map(0.0, calls))
        ds = ds.cache() if cache else ds
        for _ in range(3):
            list(ds)
        assert len(calls) == expected


def test_transformations_read_the_graph():
    x, y, _ = datasets.regression(64, 8, seed=0)
    feeds = ip.pipelines(x, y, 16, 0.0, parallel_calls=3)
    assert ip.transformations(feeds["map"]) == [
        ("TensorSliceDataset", None), ("BatchDatasetV2", None), ("MapDataset", None),
        ("OptionsDataset", None)]
    assert ("ParallelMapDatasetV2", 3) in ip.transformations(
        feeds["parallel map (3) + prefetch"])
    assert [op for op, _ in ip.transformations(feeds["map + cache + prefetch"])][-2:] == [
        "CacheDatasetV2", "PrefetchDataset"]
    with pytest.raises(ValueError, match="expected a tf.data.Dataset"):
        ip.transformations([1, 2])


def test_decode_map_rejects_negative_delay():
    with pytest.raises(ValueError, match="delay_s must be"):
        ip.decode_map(-0.1)


def test_time_feeds_warms_every_row_alike_and_times_whole_blocks():
    made, stepped = [], []

    def feed(name):
        def make():
            made.append(name)
            return iter([(v,) for v in range(5)])
        return make, lambda v: stepped.append((name, v))

    out = ip.time_feeds({"a": feed("a"), "b": feed("b")}, steps=3, warmup=1, rounds=2)
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())
    # one untimed pass each, then per round a fresh iterator, interleaved a, b, a, b
    assert made == ["a", "b", "a", "b", "a", "b"]
    assert [v for n, v in stepped if n == "a"] == [0, 1, 2, 3, 4] + [0, 1, 2, 3] * 2
    with pytest.raises(ValueError, match="fewer than warmup \\+ steps = 6"):
        ip.time_feeds({"a": feed("a")}, steps=5, warmup=1, rounds=1)


def test_measure_input_reports_every_row(four_devices):
    x, y, _ = datasets.regression(16 * 3, 8, seed=0)
    res = ip.measure_input(ip.pipelines(x, y, 16, 0.0), x, y, 16, four_devices[0],
                           hidden=(8,), steps=2, warmup=1, rounds=1)
    assert list(res["seconds"]) == ["compute", "input alone", "map", "map + prefetch",
                                    "parallel map (4) + prefetch", "map + cache + prefetch"]
    assert res["verdict"] in ("input-bound", "compute-bound")


def _base():
    x, y, _ = datasets.regression(64, 8, seed=0)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16), ip.decode_map(0.0)


def test_check_compute_bound():
    base, decode = _base()
    assert "not answered yet" in ip.check_compute_bound(None, 0.007)
    # the solution: enough parallel calls AND a thread pool that can run them
    options = tf.data.Options()
    options.threading.private_threadpool_size = 8
    right = base.map(decode, num_parallel_calls=8).prefetch(tf.data.AUTOTUNE).with_options(options)
    assert "correct" in ip.check_compute_bound(right, 0.007, cores=2)
    autotuned = base.map(decode, num_parallel_calls=tf.data.AUTOTUNE).with_options(options)
    assert "correct" in ip.check_compute_bound(autotuned, 0.007, cores=2)
    # the prediction that ignores the pool: 8 calls, but 2 threads on 2 cores
    wrong = base.map(decode, num_parallel_calls=8).prefetch(tf.data.AUTOTUNE)
    assert "2 decode(s) run at once" in ip.check_compute_bound(wrong, 0.007, cores=2)
    assert "correct" in ip.check_compute_bound(wrong, 0.007, cores=8)  # a bigger machine
    assert "cache() is not allowed" in ip.check_compute_bound(
        base.map(decode).cache().prefetch(1), 0.007, cores=2)
    assert "should be a tf.data.Dataset" in ip.check_compute_bound(8, 0.007)


def test_check_cache_placement():
    assert "not answered yet" in ip.check_cache_placement(None)
    assert "correct" in ip.check_cache_placement(lambda b, d, a: b.map(d).cache().map(a))
    assert "not quite" in ip.check_cache_placement(lambda b, d, a: b.map(d).map(a).cache())
    assert "not quite" in ip.check_cache_placement(lambda b, d, a: b.cache().map(d).map(a))
    assert "batches, expected 4 each" in ip.check_cache_placement(
        lambda b, d, a: b.map(d).cache().map(a).take(2))


def test_check_compute_bound_accepts_a_thread_pool_of_the_maps_own():
    base, decode = _base()
    unbounded = base.map(decode, num_parallel_calls=8, use_unbounded_threadpool=True)
    assert "correct: 8 decodes" in ip.check_compute_bound(unbounded, 0.007, cores=2)
    assert "2 decode(s) run at once" in ip.check_compute_bound(
        base.map(decode, num_parallel_calls=8), 0.007, cores=2)


def test_decode_map_uses_a_sequence_of_delays_in_turn(monkeypatch):
    slept = []
    monkeypatch.setattr(ip.time, "sleep", slept.append)
    x, y, _ = datasets.regression(6 * 4, 4, seed=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).map(ip.decode_map([0.0, 0.5, 0.25]))
    for _batch in ds:
        pass
    assert slept == [0.0, 0.5, 0.25, 0.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="empty sequence"):
        ip.decode_map([])
    with pytest.raises(ValueError, match="delay_s must be"):
        ip.decode_map([0.1, -0.1])


def test_compute_map_matches_numpy():
    x, y, _ = datasets.regression(16, 8, seed=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(ip.compute_map(3, 8, seed=4))
    z, y_out = next(iter(ds))
    w = np.random.default_rng(4).standard_normal((8, 8)) / np.sqrt(8)
    ref = np.asarray(x, np.float64)
    for _ in range(3):
        ref = np.tanh(ref @ w)
    np.testing.assert_allclose(z.numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_array_equal(y_out.numpy(), y)
    with pytest.raises(ValueError, match="rounds must be"):
        ip.compute_map(0, 8)
    with pytest.raises(ValueError, match="built for 8 features"):
        tf.data.Dataset.from_tensor_slices((x[:, :4], y)).batch(4).map(ip.compute_map(1, 8))


def _finalized_chain(ds):
    """The same chain by another route: the graph of the dataset tf.data finalizes for an
    iterator (tf.raw_ops.FinalizeDataset applies the rewrites), with tf.data's own wrappers
    (Root, model, threading) left out and the op names as the trace writes them."""
    finalized = tf.raw_ops.FinalizeDataset(
        input_dataset=ds._variant_tensor,
        output_types=[s.dtype for s in tf.nest.flatten(ds.element_spec)],
        output_shapes=[s.shape for s in tf.nest.flatten(ds.element_spec)])
    graph = tf.compat.v1.GraphDef.FromString(
        tf.raw_ops.DatasetToGraphV2(input_dataset=finalized).numpy())
    nodes = {n.name: n for n in graph.node}
    node = nodes[next(n for n in graph.node if n.op == "_Retval").input[0]]
    chain = []
    while "Dataset" in node.op:
        if node.op not in ("ModelDataset", "MaxIntraOpParallelismDataset",
                           "PrivateThreadPoolDataset", "OptionsDataset"):
            chain.append(node.op.replace("Dataset", ""))
        node = nodes[node.input[0].split(":")[0]]
    return chain


def test_iterator_chain_shows_the_rewrites():
    x, y, _ = datasets.regression(64, 8, seed=0)
    rows = tf.data.Dataset.from_tensor_slices((x, y))
    base = rows.batch(8)
    off, no_autotune = tf.data.Options(), tf.data.Options()
    off.experimental_optimization.map_parallelization = False
    no_autotune.autotune.enabled = False
    cases = {  # the pipeline as written -> the chain that runs (TF 2.21's defaults)
        "stateless map": (base.map(ip.compute_map(1, 8)),
                          ["ParallelMapV2", "BatchV2", "TensorSlice"]),
        "py_function map": (base.map(ip.decode_map(0.0)),
                            ["Prefetch", "Map", "BatchV2", "TensorSlice"]),
        "synchronous": (base.map(ip.compute_map(1, 8), synchronous=True),
                        ["Prefetch", "Map", "BatchV2", "TensorSlice"]),
        "option off": (base.map(ip.compute_map(1, 8)).with_options(off),
                       ["Prefetch", "Map", "BatchV2", "TensorSlice"]),
        "autotune off": (base.map(ip.compute_map(1, 8)).with_options(no_autotune),
                         ["Map", "BatchV2", "TensorSlice"]),
        "map then batch": (rows.map(lambda a, b: (2.0 * a, b)).batch(8),
                           ["MapAndBatch", "TensorSlice"]),
        "cache": (base.map(ip.decode_map(0.0)).cache().prefetch(1),
                  ["Prefetch", "MemoryCacheImpl", "Map", "BatchV2", "TensorSlice"]),
        "interleave": (tf.data.Dataset.range(4).interleave(
            lambda i: base.map(ip.decode_map(0.0)), cycle_length=4),
            ["Prefetch", "Interleave", "Range"]),  # the outer pipeline only
        "parallel interleave": (tf.data.Dataset.range(4).interleave(
            lambda i: base, cycle_length=4, num_parallel_calls=4),
            ["ParallelInterleaveV4", "Range"]),
    }
    for name, (ds, expected) in cases.items():
        assert ip.iterator_chain(ds) == expected, name
        if name != "cache":  # the graph names the cache CacheV2, the trace its implementation
            assert _finalized_chain(ds) == expected, name
    with pytest.raises(ValueError, match="expected a tf.data.Dataset"):
        ip.iterator_chain([1, 2])


def test_iterator_chain_refuses_while_a_profiler_runs(tmp_path):
    base, _ = _base()
    tf.profiler.experimental.start(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="already running"):
            ip.iterator_chain(base)
    finally:
        tf.profiler.experimental.stop()


def test_measure_input_times_named_pipelines_alone(four_devices):
    x, y, _ = datasets.regression(16 * 3, 8, seed=0)
    feeds = ip.pipelines(x, y, 16, 0.0)
    res = ip.measure_input(feeds, x, y, 16, four_devices[0], hidden=(8,), steps=2, warmup=1,
                           rounds=1, alone=["map + prefetch", "map"])
    assert list(res["seconds"])[:3] == ["compute", "map + prefetch alone", "map alone"]
    assert "input alone" not in res["seconds"]
    with pytest.raises(ValueError, match="alone must name pipelines"):
        ip.measure_input(feeds, x, y, 16, four_devices[0], alone=["nope"])


def test_read_shards_reads_every_record_in_interleaved_order(tmp_path):
    from accel.parallel import inputs

    x, y, _ = datasets.regression(4 * 40, 2, seed=0)
    files = inputs.write_tfrecords(x, y, tmp_path, num_files=4)
    names = tf.data.Dataset.from_tensor_slices(files)
    chunks = list(names.interleave(ip.read_shards(0.0, records_per_read=16), cycle_length=4,
                                   num_parallel_calls=4))
    # 40 records per file: reads of 16, 16, 8 from each file, files in turn
    assert [len(c) for c in chunks] == [16] * 8 + [8] * 4
    records = np.concatenate([c.numpy() for c in chunks])
    by_file = [list(tf.data.TFRecordDataset(f).as_numpy_iterator()) for f in files]
    expected = [r for start, size in ((0, 16), (16, 16), (32, 8)) for f in by_file
                for r in f[start:start + size]]
    assert records.tolist() == expected
    assert set(ip.time_passes({"a": names}, rounds=1)) == {"a"}
    with pytest.raises(ValueError, match="datasets is empty"):
        ip.time_passes({})


def test_local_data_service_shards_and_stops():
    import socket

    service = tf.data.experimental.service
    ds = tf.data.Dataset.range(12)
    with ip.local_data_service(workers=2) as target:
        off = sorted(int(v) for v in ds.apply(service.distribute(
            service.ShardingPolicy.OFF, service=target)))
        dynamic = sorted(int(v) for v in ds.apply(service.distribute(
            service.ShardingPolicy.DYNAMIC, service=target)))
    assert off == sorted(list(range(12)) * 2)  # every worker runs the whole dataset
    assert dynamic == list(range(12))  # the dispatcher hands each split to one worker
    port = int(target.rsplit(":", 1)[1])
    with socket.socket() as s:  # the dispatcher's port is free again: it was stopped
        # its closed connections may linger in TIME_WAIT, which SO_REUSEADDR lets a bind pass;
        # a listener still bound to the port would fail the bind all the same
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("localhost", port))
    with pytest.raises(ValueError, match="workers must be"):
        with ip.local_data_service(workers=0):
            pass


def test_check_parallel_maps():
    assert "not answered yet" in ip.check_parallel_maps(None)
    assert "should be a dict" in ip.check_parallel_maps({"scale": True})
    # the solution: only stateless functions are rewritten (map_parallelization.cc skips
    # stateful ones: tf.random.uniform and tf.print are stateful, stateless_uniform is not)
    solution = {"scale": True, "augment": False, "seeded augment": True, "logged": False}
    assert "correct" in ip.check_parallel_maps(solution)
    wrong = dict(solution, logged=True)
    assert "disagrees with you on ['logged']" in ip.check_parallel_maps(wrong)


def test_chapter_08_hand_pipeline_equals_tfrecord_dataset(tmp_path):
    """Chapter 08, section 1: the pipeline written out by hand is tfrecords.tfrecord_dataset."""
    from accel.parallel import data as dp
    from accel.parallel import inputs as tfrecords

    x, y, _ = datasets.regression(256, features=8, seed=0)
    files = tfrecords.write_tfrecords(x, y, tmp_path, num_files=4)
    ds = tf.data.Dataset.from_tensor_slices(files)
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=len(files), block_length=1)
    ds = ds.batch(64, drop_remainder=True)
    ds = ds.map(lambda s: tfrecords.parse_examples(s, features=8, outputs=1))
    ds = ds.map(lambda x, y: tuple(zip(*dp.split_batch((x, y), 4), strict=True)))
    theirs = tfrecords.tfrecord_dataset(files, features=8, outputs=1, batch_size=64, towers=4)
    for mine, ref in zip(ds, theirs, strict=True):
        for a, b in zip(tf.nest.flatten(mine), tf.nest.flatten(ref), strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
