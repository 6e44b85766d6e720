"""accel.course.memory: chapters 04 and 05's exercise checks with the right answers (worked out by
hand here) and a wrong one each, the temporaries model, the inter-op overlap probe and the
per-session thread pool."""

import keras
import pytest
import tensorflow as tf

from accel.course import memory as course_memory
from accel.memory import config as memory_config


def _mlp(dtype=None):
    L = keras.layers
    return keras.Sequential([keras.Input((512,)), L.Dense(512, "relu", dtype=dtype),
                             L.Dense(512, "relu", dtype=dtype), L.Dense(10, dtype=dtype)])


def _sum_first(seed):  # 04 exercise 1, the solution: the sum of `a` before the square
    a = tf.random.stateless_uniform((1024, 2048), seed=seed)
    total = tf.reduce_sum(a)
    with tf.control_dependencies([total]):
        squares = tf.square(a)  # a's last reader: it may write into a's buffer
    return tf.reduce_sum(squares) + total


def _square_first(seed):  # the wrong order: `a` is read again after the square
    a = tf.random.stateless_uniform((1024, 2048), seed=seed)
    squares = tf.square(a)
    with tf.control_dependencies([squares]):
        total = tf.reduce_sum(a)
    return tf.reduce_sum(squares) + total


def test_04_exercise_1_one_buffer():
    assert course_memory.check_one_buffer(None) == "exercise 1: not answered yet"
    assert course_memory.check_one_buffer(_sum_first).startswith("exercise 1: correct: 8 MiB")
    # data flow alone: either order may run (its peak varies), so the check refuses it
    assert "nothing makes the sum of `a` run before the square" in course_memory.check_one_buffer(
        course_memory._sum_and_squares)
    assert "not yet: 16 MiB" in course_memory.check_one_buffer(_square_first)
    assert "value changed" in course_memory.check_one_buffer(
        lambda seed: tf.reduce_sum(tf.random.stateless_uniform((1024, 2048), seed=seed)))


def test_04_exercise_1_fresh_process_measures_the_same_orders():
    # a peak above one buffer is measured again in a fresh process (this one's other work can
    # add to the shared allocator's peak): that measurement must still tell the orders apart
    seed = tf.constant([0, 5])
    for fn, mib in ((_sum_first, 8), (_square_first, 16)):
        step = tf.function(fn)
        step(seed)
        assert round(course_memory._fresh_peak(step, seed) / 2**20) == mib


def test_05_exercise_1_half_pays():
    # float32 keeps the two ReLU outputs: 2 * 512 * 4 = 4096 B per example. mixed_float16 keeps
    # them in float16 plus the float16 input (3 * 512 * 2 = 3072 B per example) and float16
    # copies of the two later kernels, (512 * 512 + 512 * 10) * 2 = 534,528 B whatever the
    # batch: equal at 534,528 / 1,024 = 522, fewer bytes from 523 on
    mixed, plain = _mlp("mixed_float16"), _mlp()
    assert course_memory.check_half_pays(523, mixed, plain).startswith("exercise 1: correct")
    assert "not yet" in course_memory.check_half_pays(522, mixed, plain)
    assert course_memory.check_half_pays(None, mixed, plain) == "exercise 1: not answered yet"


def test_05_exercise_2_overflow_steps():
    # 8 * 2**15 = 262144, 8 * 2**14 = 131072 and 8 * 2**13 = 65536 all exceed float16's 65504
    # (inf: skipped, scale halved); 8 * 2**12 = 32768 is finite
    assert course_memory.check_overflow_steps((3, 4096)).startswith("exercise 2: correct")
    assert "not yet" in course_memory.check_overflow_steps((2, 8192.0))
    assert course_memory.check_overflow_steps(None) == "exercise 2: not answered yet"


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


def test_step_breakdown_counts_the_matmuls_by_hand(tmp_path):
    """Two residual blocks: 4 forward matmuls; backward 2 per matmul, less the first block's
    input gradient (x needs none): 7. Each direction's work and wall time are positive."""
    parts = course_memory.step_breakdown(str(tmp_path), batch=64, blocks=2, width=16)
    labels = [label for *_, label in parts["intervals"]]
    assert (labels.count("forward"), labels.count("backward")) == (4, 7)
    assert all(parts[k] > 0 for k in ("forward_work_ms", "backward_work_ms", "forward_ms",
                                      "backward_ms"))
    assert all(lane.startswith("thread ") for lane, *_ in parts["intervals"])
