"""accel.course.memory: chapter 04's exercise checks with the right answers (worked out by hand
here), the inter-op overlap probe and the per-session thread pool."""

import keras
import pytest
import tensorflow as tf

from accel.course import memory as course_memory
from accel.memory import config as memory_config


def _cnn():
    L = keras.layers
    return keras.Sequential([keras.Input((32, 32, 3)),
                             L.Conv2D(16, 3, padding="same", activation="relu"), L.MaxPooling2D(),
                             L.Conv2D(32, 3, padding="same", activation="relu"), L.MaxPooling2D(),
                             L.Flatten(), L.Dense(10)])


def test_exercise_1_slot_bytes():
    # conv 3x3x3x16 + 16, conv 3x3x16x32 + 32, dense (8*8*32)x10 + 10 = 25,578 float32 weights;
    # momentum keeps one slot per weight
    cnn = _cnn()
    assert course_memory.check_slot_bytes(25_578 * 4, cnn) == "right"
    assert course_memory.check_slot_bytes(2 * 25_578 * 4, cnn).startswith("not yet")
    assert course_memory.check_slot_bytes(None, cnn).startswith("not yet")


def test_exercise_2_formats():
    # float16: max 65504, smallest subnormal 2**-24 ~ 6e-8, so 1e-8 -> 0 and 7e4 -> inf;
    # bfloat16: 7 mantissa bits, so 1 + 2**-9 rounds to 1; float16 (10 bits) keeps it
    assert course_memory.check_formats(("bfloat16", "float16")) == "right"
    assert course_memory.check_formats(["bfloat16", "float16"]) == "right"
    assert course_memory.check_formats(("float16", "bfloat16")).startswith("not yet")
    assert course_memory.check_formats(None).startswith("not yet")


def test_chains_never_overlap_on_one_inter_op_thread_and_do_on_two():
    graph, fetches = course_memory.two_chains(n=128, depth=6)
    one = tf.compat.v1.Session(graph=graph, config=memory_config.tf1_config(
        inter_op_threads=1, use_per_session_threads=True))
    two = tf.compat.v1.Session(graph=graph, config=memory_config.tf1_config(
        inter_op_threads=2, use_per_session_threads=True))
    assert [course_memory.overlapping_pairs(one, fetches) for _ in range(3)] == [0, 0, 0]
    assert max(course_memory.overlapping_pairs(two, fetches) for _ in range(5)) > 0
    # both sessions compute the same sums (one graph, seeded ops)
    assert one.run(fetches) == pytest.approx(two.run(fetches), rel=1e-5)


def test_per_session_pool_adds_its_own_threads():
    graph, _ = course_memory.two_chains(n=8, depth=1)
    before = course_memory.process_threads()
    sess = tf.compat.v1.Session(graph=graph, config=memory_config.tf1_config(
        inter_op_threads=3, use_per_session_threads=True))
    assert course_memory.process_threads() - before == 3
    sess.close()


def test_two_chains_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n must be"):
        course_memory.two_chains(n=0)


@pytest.mark.slow
def test_bench_memory_quick():
    """The quick benchmark runs (in a fresh process) and reports each variant against plain,
    recomputed here from its results. At the quick sizes (16 KiB tensors) which variant peaks
    lower is decided by the allocator's chunk sizes, not by the variant, so that claim is
    tested at a size where it holds: tests/memory/test_memory.py, recompute_saves_memory."""
    out = course_memory.bench_memory(quick=True)
    res = out["results"]
    assert set(res) == {"plain", "recompute", "float16", "bfloat16"}
    for name, r in res.items():
        assert out["ratios"][name] == {k: r[k] / res["plain"][k] for k in ("peak_mib", "seconds")}
        assert r["peak_mib"] > 0 and r["seconds"] > 0
