"""accel.course.memory: chapters 04 and 05's exercise checks with the right answers (worked out by
hand here) and a wrong one each, the temporaries model, the inter-op overlap probe and the
per-session thread pool."""

import textwrap

import keras
import pytest
import tensorflow as tf

from accel.course import memory as course_memory
from accel.memory import config as memory_config
from accel.procs import run_python


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


def test_04_exercise_2_plan_fits():
    """By hand, in units of s h = 16,777,216 bytes per sequence (the plans' table at batch 1):
    keep everything 6208, selective 1248, full 258, sqrt(L) 1176. The B200 holds 180e9 bytes;
    16 bytes x 6,648,303,616 parameters = 106,372,857,856 of states leave 73,627,142,144:
    keep everything does not fit one sequence (104.2e9); selective fits 3 (62.8e9; 4 would
    be 83.8e9) and adds the least work of the plans that fit (1/21 against 1/3)."""
    assert course_memory.check_plan_fits(None) == "exercise 2: not answered yet"
    assert course_memory.check_plan_fits(("selective", 3)).startswith(
        "exercise 2: correct: 'selective' at micro-batch 3")
    assert "fits a larger micro-batch" in course_memory.check_plan_fits(("selective", 2))
    assert "more than the 180 GB" in course_memory.check_plan_fits(("selective", 4))
    assert "more than the 180 GB" in course_memory.check_plan_fits(("keep everything", 1))
    assert "less extra work" in course_memory.check_plan_fits(("full, every layer", 17))
    for bad in ("selective", ("selective", 0), ("selective", True), ("remat", 1)):
        assert "answer with a pair" in course_memory.check_plan_fits(bad)
    with pytest.raises(ValueError, match="no plan fits one sequence on the NVIDIA H100 SXM"):
        course_memory.check_plan_fits(("selective", 1), gpu="NVIDIA H100 SXM")


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


@pytest.mark.slow
def test_05_exercise_3_xla_compilations():
    """The answer by hand: the train step meets batch 64 and the last partial batch of
    1000 - 15 * 64 = 40 (both epochs reuse them), the test step 100 and 50; XLA compiles one
    program per shape, so 4. Run in a fresh Python whose XLA dumps every program, counted as the
    chapter counts them."""
    code = textwrap.dedent("""
        import os, shutil, tempfile
        dump_dir = tempfile.mkdtemp(prefix="xla_dump_test_")
        os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump_dir}"
        from accel.course import memory as course_memory
        def compiled(name):
            return sum(f"_{name}_" in f and f.endswith(".before_optimizations.txt")
                       for f in os.listdir(dump_dir))
        for answer in (None, 4, 3, "4"):
            print(course_memory.check_xla_compilations(answer, compiled))
        shutil.rmtree(dump_dir)
    """)
    out = run_python(code, timeout=300).strip().splitlines()
    assert out == ["exercise 3: not answered yet", "exercise 3: correct: 4 compilations",
                   "exercise 3: not yet: 3 is not it; count the batch sizes each loop meets",
                   "exercise 3: answer with a number of compilations (an int >= 0)"], out


def test_chains_never_overlap_on_one_inter_op_thread_and_do_on_two():
    graph, fetches = course_memory.two_chains(n=128, depth=6)
    one = tf.compat.v1.Session(graph=graph, config=memory_config.tf1_config(
        inter_op_threads=1, use_per_session_threads=True))
    two = tf.compat.v1.Session(graph=graph, config=memory_config.tf1_config(
        inter_op_threads=2, use_per_session_threads=True))
    assert [course_memory.overlapping_pairs(one, fetches) for _ in range(3)] == [0, 0, 0]
    # two threads overlap only when the OS runs both at once: on a loaded 2-core machine (the
    # suite's three workers) a run can go by without it, so try until one overlaps
    assert any(course_memory.overlapping_pairs(two, fetches) > 0 for _ in range(30))
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


def test_step_memory_timeline_by_hand(tmp_path):
    """Batch 1024, width 128, 2 blocks: each plain forward block allocates a 1024 x 512 product
    (2 MiB, its ReLU then writes in place) and a 1024 x 128 one (0.5 MiB, the residual add
    writes in place), all kept for the backward pass; recomputation allocates each block's
    products once more during the backward pass."""
    plain = course_memory.step_memory_timeline("plain", 1024, 2, 128, logdir=str(tmp_path / "p"))
    forward = [e for e in plain if e.op in ("MatMul", "MatMul_1", "MatMul_2", "MatMul_3")]
    assert [e.requested for e in forward] == [2 * 2**20, 2**19, 2 * 2**20, 2**19]
    # ReLU and the residual add write into their input's buffer: no allocation of their own
    assert not [e for e in plain if e.op.startswith(("Relu", "add"))]
    assert all(a.time <= b.time for a, b in zip(plain, plain[1:], strict=False))
    recomputed = course_memory.step_memory_timeline("recompute", 1024, 2, 128)
    products = [e for e in recomputed if e.requested == 2 * 2**20 and "gradient_tape" not in e.op]
    assert len(products) == 4  # 2 forward + 2 rebuilt
    assert course_memory._backward_start(plain) is not None
    import matplotlib.pyplot as plt

    fig = course_memory.figure_memory_timeline({"plain": plain, "recompute": recomputed})
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] \
        == ["plain", "recompute"]
    plt.close(fig)


def test_transformer_memory_against_hand_counts():
    """GPT-3 6.7B's shape (32 layers, hidden 4096, 32 heads), sequence 4096, batch 1. Model
    states: 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (ZeRO, section 3.1: 2 + 2 + 12).
    Activations per layer: 4096 * 4096 * (34 + 5 * 32 * 4096 / 4096) = 16,777,216 * 194 =
    3,254,779,904 bytes; FlashAttention keeps 16,777,216 * 34 = 570,425,344."""
    from accel.costmodel.zero import ADAM_MIXED_BYTES_PER_PARAM
    from accel.memory.estimate import mixed_precision_accounting

    params = 6_648_000_000
    assert sum(course_memory.MIXED_ADAM_BYTES.values()) == ADAM_MIXED_BYTES_PER_PARAM == 16
    assert sorted(course_memory.MIXED_ADAM_BYTES.values()) == sorted(
        mixed_precision_accounting("adam")["classic mixed"].values())
    out = course_memory.transformer_memory(params, 32, 4096, 32, 4096)
    assert out["master weights (fp32)"] == 4 * params
    assert out["model states"] == 16 * params == 106_368_000_000
    assert out["activations"] == 32 * 3_254_779_904
    assert out["total"] == 16 * params + 32 * 3_254_779_904
    flash = course_memory.transformer_memory(params, 32, 4096, 32, 4096, flash_attention=True)
    assert flash["activations"] == 32 * 570_425_344
    assert course_memory.transformer_memory(params, 32, 4096, 32, 4096, batch=2)[
        "activations"] == 2 * out["activations"]
    megatron = course_memory.transformer_memory(params, 32, 4096, 32, 4096,
                                                state_bytes=course_memory.MEGATRON_BF16_BYTES)
    assert megatron["model states"] == 18 * params  # 2 + 4 + 4 + 4 + 4, fp32 main gradients
    assert megatron["main gradients (fp32)"] == 4 * params
    assert megatron["activations"] == out["activations"]
    with pytest.raises(ValueError, match="hidden .4096. must be a multiple of heads .3."):
        course_memory.transformer_memory(params, 32, 4096, 3, 4096)
    with pytest.raises(ValueError, match="params must be"):
        course_memory.transformer_memory(0, 32, 4096, 32, 4096)


def test_recomputation_plans_against_hand_counts():
    """The same shape, in units of s b h = 16,777,216 bytes (A = 194 of them per layer, the
    scores' 5 a s / h = 160): keep everything 32 * 194 = 6208; selective 32 * 34 + 160 = 1248;
    full 32 * 2 + 194 = 258; sqrt(32) -> segments of 6 layers, ceil(32 / 6) = 6 inputs kept:
    6 * 2 + 6 * 194 = 1176. Extra FLOPs: a forward is 1/3 of a step (3 passes); the score
    matmuls 4 b s^2 h over the step's 72 b s h^2 (1 + s / 6h) = (1/18) / (7/6) = 1/21 at s = h."""
    unit = 4096 * 4096
    plans = course_memory.recomputation_plans(32, 4096, 32, 4096)
    want = {"keep everything": (6208, 0.0), "selective": (1248, 1 / 21),
            "full, every layer": (258, 1 / 3), "sqrt(L) segments": (1176, 1 / 3)}
    assert set(plans) == set(want)
    for name, (units, extra) in want.items():
        assert plans[name][0] == units * unit
        assert plans[name][1] == pytest.approx(extra, rel=1e-12)
    with pytest.raises(ValueError, match="layers must be"):
        course_memory.recomputation_plans(0, 4096, 32, 4096)
