"""accel.course.model_parallel: byte counts and memory against hand counts, the
wavefront's variants against each other's outputs, the hybrid's traffic by hand, and the
exercises' solutions."""

import numpy as np
import pytest

from accel.costmodel import planner as pl
from accel.course import model_parallel as course
from accel.parallel import model as mp
from accel.parallel.layers import mlp_layers

B, W = course.SPLIT_BATCH, course.DENSE_WIDTH


def test_split_byte_counts_by_hand(four_devices):
    counts = course.count_splits(four_devices[:2], overlap=False)
    act = B * W * 4  # one [32, 1024] float32 activation
    assert counts["dense, split by layers"] == {"forward": act, "backward": act,
                                                "total": 2 * act, "input": 0}
    # by neurons: the input reaches device 1, then after each of the first 3 layers each
    # device sends its half to the other (the step fetches no loss, and the gradient of a sum
    # does not need its value, so the last layer's halves are not gathered: TensorFlow prunes
    # what nothing needs)
    half = act // 2
    assert counts["dense, split by neurons"]["forward"] == act + 3 * 2 * half
    assert counts["dense, split by neurons"]["input"] == act
    # CNN by layers: conv2's output [32, 8, 8, 64] forward, its gradient back
    assert counts["CNN, split by layers"]["forward"] == 4 * B * 8 * 8 * 64
    cnn = counts["CNN, two towers (AlexNet)"]
    every = counts["CNN, split by channels"]
    assert counts["CNN, split by layers"]["total"] < cnn["total"] < every["total"]
    # towers: the image to tower 1 (32x32x3), conv2 outputs both ways (8x8x32), the flattened
    # features both ways (4x4x32 = 512 each)
    assert cnn["input"] == 4 * B * 32 * 32 * 3
    assert cnn["forward"] == 4 * B * (32 * 32 * 3 + 2 * 8 * 8 * 32 + 2 * 512)


def test_memory_per_device_is_the_variables_there(four_devices):
    sizes = [8, 16, 16, 4]
    model = mp.SplitModel(mp.split(mlp_layers(sizes), four_devices[:3], [8]))
    mem = course.memory_per_device(model)
    per_layer = [(8 * 16 + 16) * 4, (16 * 16 + 16) * 4, (16 * 4 + 4) * 4]
    for dev, b in zip(four_devices[:3], per_layer, strict=True):
        e = mem[dev]["split"]
        assert (e.weights, e.gradients, e.optimizer_slots) == (b, b, 2 * b)
        assert mem[dev]["data parallel"].weights == sum(per_layer)


def test_wavefront_variants_compute_the_same(four_devices):
    res = course.wavefront_times(four_devices[:2], rounds=1, repeat=1, trace_runs=1)
    assert res["same outputs"] is True
    # how much the traced runs overlap is a timing: the chapter prints it; here only its range
    assert 0.0 <= res["traced layer after layer"]["both in flight"] <= 1.0


def test_wavefront_limit_by_hand():
    assert course.wavefront_limit(6) == 12 / 7  # 2T / (T + 1)
    assert course.wavefront_limit(24) == 48 / 25
    assert abs(course.wavefront_limit(8, 4) - 32 / 11) < 1e-12
    assert course.wavefront_grid(2, 2).splitlines()[1].split(": ")[1].split() == [".", "t0", "t1"]
    # the traced overlap of two lanes: both in flight 1..2 of 0..3; 4 s of ops in 3 s
    o = course.overlap_of({"a": [(0.0, 2.0)], "b": [(1.0, 3.0)]})
    assert o == {"both in flight": 1 / 3, "busy / span": 4 / 3}


def test_exercise_solutions(four_devices):
    # exercise 1: the cut after the 64-wide layer (2 layers on the first device) crosses
    # 16x fewer bytes than the others, but leaves the 1024 x 1024 layer and most parameters
    # on the second device; balance="bytes" cuts after 3 layers
    assert "not answered yet" in course.check_cut(None, four_devices)
    assert "correct" in course.check_cut((2, False), four_devices)
    assert "not quite" in course.check_cut((2, True), four_devices)
    assert "not quite" in course.check_cut((3, False), four_devices)
    assert "not quite" in course.check_cut(2, four_devices)
    # exercise 2: the projection costs V / 12h = 8/3 blocks; 32 + 8/3 block-times over 4 stages:
    # no stage can take fewer than 9 (three stages of at most 8 leave 8 blocks + the projection)
    assert "not answered yet" in course.check_embedding_split(None)
    for right in ([9, 9, 9, 5], [9, 9, 8, 6], [8, 9, 9, 6]):
        assert "correct" in course.check_embedding_split(right), right
    for wrong in ([8, 8, 8, 8], [10, 8, 8, 6], [9, 9, 9], [9, 9, 9, 6], "8888"):
        assert "not quite" in course.check_embedding_split(wrong), wrong
    # exercise 3: the cut before c carries b's output (64 floats) and, for the skip, a's (512)
    assert "not answered yet" in course.check_skip_cut(None, four_devices)
    assert "correct" in course.check_skip_cut(64 * 4 + 512 * 4, four_devices)
    assert "not quite" in course.check_skip_cut(64 * 4, four_devices)
    # exercise 4: under 1F1B stage j of p holds p - j micro-batches: 4 against 1
    assert "not answered yet" in course.check_stage_memory(None)
    assert "correct" in course.check_stage_memory(4)
    assert "not quite" in course.check_stage_memory(2)


def test_naive_trace_lists_every_device(four_devices):
    res = course.naive_trace(four_devices, sizes=(8, 16, 16, 16, 4), batch=8, warmup=1)
    assert list(res["idle"]) == four_devices
    assert all(0 <= f < 1 for f in res["idle"].values())
    assert np.isfinite(res["span"])


def test_stage_bytes_equal_chapter_07_split(four_devices):
    sizes = [8, 16, 16, 16, 4]
    split = mp.split(mlp_layers(sizes), four_devices[:3], [8])
    mem = course.memory_per_device(mp.SplitModel(split))
    layer_params = [a * b + b for a, b in zip(sizes, sizes[1:], strict=False)]
    predicted = pl.stage_state_bytes(layer_params, split.balance, "fp32")
    for dev, (w, g, o) in zip(split.devices, predicted, strict=True):
        e = mem[dev]["split"]
        assert (w, g, o) == (e.weights, e.gradients, e.optimizer_slots)


def test_cut_table_by_hand(four_devices):
    rows = course.cut_table(four_devices)
    widths = course.CUT_SIZES[1:-1]  # the activation after each cut: [64, width] both ways
    assert [r["crossing"] for r in rows] == [2 * 64 * w * 4 for w in widths]
    per_layer = [(a * b + b) * 4 for a, b in zip(course.CUT_SIZES, course.CUT_SIZES[1:],
                                                   strict=False)]
    for r in rows:
        k = r["first"]
        assert r["param_bytes"] == [sum(per_layer[:k]), sum(per_layer[k:])]
    with pytest.raises(ValueError, match="2 devices"):
        course.cut_table(four_devices[:1])


def test_hybrid_traffic_by_hand(four_devices):
    from accel.parallel import trace
    from accel.training import squared_error

    sizes, batch = [8, 16, 16, 16, 16, 4], 32
    partition = mp.split(mlp_layers(sizes), four_devices[:2], [sizes[0]])
    replicas = [four_devices[:2], four_devices[2:]]
    step = mp.make_split_step(partition, squared_error, 0.1, replicas=replicas)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, sizes[0])).astype(np.float32)
    y = rng.normal(size=(batch, sizes[-1])).astype(np.float32)
    moved = trace.transfers_of(step, x, y)
    counts = course.hybrid_traffic(moved, replicas)
    params = sum(p.param_bytes for p in partition.parts)  # every weight once each way
    assert params == 4 * sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))
    assert counts == {
        course.HYBRID_KINDS[0]: 2 * 2 * (batch // 2) * 16 * 4,  # 2 replicas, both directions
        course.HYBRID_KINDS[1]: params,
        course.HYBRID_KINDS[2]: params,
        course.HYBRID_KINDS[3]: (batch // 2) * (sizes[0] + 2 * sizes[-1]) * 4,  # x half, labels
        course.HYBRID_KINDS[4]: 2 * 4}
    assert sum(counts.values()) == trace.crossing_bytes(moved)["total"]
    with pytest.raises(ValueError, match="two replicas"):
        course.hybrid_traffic(moved, [four_devices[:2], four_devices[1:3]])
    with pytest.raises(ValueError, match="outside the replicas"):
        course.hybrid_traffic(moved, [four_devices[:2]])
    with pytest.raises(ValueError, match="non-empty"):
        course.hybrid_traffic(moved, [])
