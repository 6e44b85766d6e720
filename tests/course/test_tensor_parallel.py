"""accel.course.tensor_parallel: the exercises' solutions, the steps agree with each other (never
their timings), and the figures draw."""

import numpy as np
import pytest

from accel.course import tensor_parallel as course
from accel.parallel import megatron as tp


def test_exercise_1_solution():
    # per device, per layer and step, 8 devices, 16-bit; a hand count of Llama 3 70B's layer:
    # 2 x 8192^2 (q, o) + 2 x 8192 x 1024 (k, v) + 3 x 8192 x 28672 (SwiGLU) + 2 x 8192 (norms)
    params = 2 * 8192 ** 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert params == 855_654_400
    act = 8192 * 8192 * 2                                   # one sequence's activation, bytes
    ring, direct = 2 * 7 / 8, 7
    assert 4 * ring * act < ring * 2 * params               # A: 1 sequence, ring: data
    assert 4 * direct * 4 * act > direct * 2 * params       # B: 4 sequences, direct: tensor
    assert 4 * ring * 3 * act < ring * 2 * params           # C: 3 sequences, ring: data
    assert 4 * 3 * 8192 * 8192 == 12 * 8192 ** 2            # where 12 h^2 would call C a tie
    check = course.check_tp_vs_dp
    assert check(None).startswith("exercise 1: not answered yet")
    assert check({"A": "data", "B": "tensor", "C": "data"}).startswith("exercise 1: correct")
    assert "case(s) B" in check({"A": "data", "B": "data", "C": "data"})
    assert "case(s) A, C" in check({"A": "tensor", "B": "tensor", "C": "tensor"})
    assert "must be 'tensor' or 'data'" in check({"A": "tp", "B": "tensor", "C": "data"})
    assert "dict with keys" in check(["data"])


def test_tp_efficiency_against_the_layer_model_and_a_hand_count():
    from accel.costmodel import tensor_parallel as tpcost
    for n in (2, 4, 8):                                     # a link of LINKS: the same model
        ref = tpcost.tp_layer_time(8, 1024, 4096, n, "NVIDIA A100", "PCIe 4.0 x16")
        assert course.tp_efficiency(8, 1024, 4096, n, "NVIDIA A100", "PCIe 4.0 x16") \
            == pytest.approx(ref["efficiency"], rel=1e-12)
    # B200 over NVLink 5 (900 GB/s one way), bf16 peak 2,250 TFLOP/s at 50%, by hand
    compute_1 = 3 * 24 * 8 * 1024 * 4096 ** 2 / (2250e12 * 0.5)
    comm = 4 * 2 * 7 / 8 * 8 * 1024 * 4096 * 2 / 900e9
    got = course.tp_efficiency(8, 1024, 4096, 8, "NVIDIA B200", "NVLink 5 (B200, per GPU)",
                               precision="bf16")
    assert got == pytest.approx(compute_1 / (8 * (compute_1 / 8 + comm)), rel=1e-12)
    # an achievable bandwidth in place of the nominal one
    slow = course.tp_efficiency(8, 1024, 4096, 8, "NVIDIA H100 SXM", "NVLink 4 (H100, per GPU)",
                                precision="bf16", link_gbs=370)
    fast = course.tp_efficiency(8, 1024, 4096, 8, "NVIDIA H100 SXM", "NVLink 4 (H100, per GPU)",
                                precision="bf16")
    assert slow < fast
    for bad in ({"utilization": 0}, {"utilization": 1.5}, {"link_gbs": 0}, {"link_gbs": True}):
        with pytest.raises(ValueError):
            course.tp_efficiency(8, 1024, 4096, 8, "NVIDIA A100", "PCIe 4.0 x16", **bad)
    with pytest.raises(ValueError):
        course.tp_efficiency(8, 1024, 4096, 8, "NVIDIA A100", "NVLink 9")


def test_exercise_2_solution():
    check = course.check_attention_split
    assert check(None).startswith("exercise 2: not answered yet")
    assert check({"A": "tensor", "B": "ring", "C": "ulysses"}).startswith("exercise 2: correct")
    assert check({"A": "tensor", "B": "all_gather", "C": "ulysses"}).startswith(
        "exercise 2: correct")
    # Ulysses cannot split B's one KV head per tensor rank; C's ring sends 4x more
    assert "case(s) B, C" in check({"A": "tensor", "B": "ulysses", "C": "ring"})
    assert "must be one of" in check({"A": "tp", "B": "ring", "C": "ulysses"})
    assert "dict with keys" in check(["tensor"])


def test_activation_table_against_the_planner_and_a_hand_count():
    from accel.costmodel import planner
    s, h, a, t, c = 2048, 1024, 16, 4, 2
    table = course.activation_table(s, h, a, t, c)
    model = planner.Transformer(layers=1, hidden=h, heads=a, seq=s, vocab=1024)
    for sp, layout in ((False, "TP"), (True, "TP+SP")):
        for att in ("materialized", "fused"):
            plan = planner.Plan(data=1, tensor=t, pipeline=1, recompute="none",
                                sequence_parallel=sp, attention=att)
            assert table[layout][att] == pytest.approx(planner.layer_activations(model, plan)[0])
    # by hand: s b h / (t c) (34 + 5 a s / h) = 2048 * 1024 / 8 * (34 + 160) bytes
    assert table["TP+SP+CP"]["materialized"] == 2048 * 1024 // 8 * 194
    # Llama 3 70B's shape at 131,072 tokens, TP 8: the scores dominate unless fused
    big = course.activation_table(131072, 8192, 64, 8, 16)
    assert big["TP"]["materialized"] / big["TP"]["fused"] > 40
    for bad in (dict(tensor=3), dict(context=3), dict(seq=0)):
        with pytest.raises(ValueError):
            course.activation_table(**{**dict(seq=2048, hidden=1024, heads=16, tensor=4,
                                              context=2), **bad})


def test_exercise_3_solution():
    # device 1 of 2, float64, x3 (weight, Adam's m and v): its 2 heads' q/k/v kernels 3 x 16x2x4
    # and biases 3 x 2x4, output rows 2x4x16, up's 32 columns 16x32 + 32, down's 32 rows 32x16
    # (what the chapter's block split over 2 devices holds on CPU:1, read from its variables)
    assert course.check_keras_held(None).startswith("exercise 3: not answered yet")
    assert course.check_keras_held(38208).startswith("exercise 3: correct")
    assert "weights alone" in course.check_keras_held(12736)
    assert course.check_keras_held(19104).startswith("exercise 3: not quite")


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_the_three_steps_train_alike(four_devices, kind):
    steps = course.train_steps(four_devices, 2, kind, batch=2, seq=4, hidden=16, heads=4,
                               lr=0.05)
    curves = {k: [fn() for _ in range(3)] for k, fn in steps.items()}
    assert set(curves) == ({"single", "hand", "dtensor"} if kind == "mlp" else {"single", "hand"})
    for k in curves:
        np.testing.assert_allclose(curves[k], curves["single"], rtol=1e-4)
    assert curves["single"][-1] < curves["single"][0]


def test_local_updates_train_alike(four_devices):
    """``local_update=True`` (each shard's update on its own device, what the benchmark times)
    changes where the update runs, not what it computes."""
    steps = course.train_steps(four_devices, 2, "block", batch=2, seq=4, hidden=16, heads=4,
                               lr=0.05, local_update=True)
    curves = {k: [fn() for _ in range(3)] for k, fn in steps.items()}
    np.testing.assert_allclose(curves["hand"], curves["single"], rtol=1e-4)


def test_counted_bytes_equal_the_formula(four_devices):
    b = course.counted_bytes(four_devices, 4, "mlp", batch=2, seq=4, hidden=16, heads=4)
    # 2 all-reduces x 3 other devices x 2*4*16 float32
    assert b == {"counted_min": 3072, "counted_max": 3072, "formula": 3072}


def test_figures_draw():
    import matplotlib.pyplot as plt

    for fig in (course.figure_sequence_parallel(),):
        assert fig.axes
        plt.close(fig)


B, S, H, HEADS = 2, 4, 8, 4  # as in tests/parallel/test_tensor.py


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_all_reduces_and_bytes_counted_in_the_graph_that_ran(four_devices, n, kind):
    """forward + backward (with the input's gradient, as for a layer inside a stack): each
    all-reduce sends the activation from every device to each of the n - 1 others."""
    got = course.counted_bytes(four_devices, n, kind, batch=B, seq=S, hidden=H, heads=HEADS)
    per = {"mlp": 2, "block": 4}[kind]  # all-reduces per step, by hand (Megatron-LM section 3)
    activation = B * S * H * 4
    assert got["counted_min"] == got["counted_max"] == per * (n - 1) * activation
    assert tp.bytes_per_step(kind, [B, S, H], n) == per * (n - 1) * activation


def test_megatron_layouts_by_hand_and_the_reported_table(four_devices):
    """Megatron's split as DTensor layouts (w1 by columns with b1, w2 by rows, b2 whole; the
    swapped one the other way round) against literal sharding specs, and the cited table."""
    from accel.parallel import mesh as dmesh

    mesh = dmesh.make_mesh(four_devices, {"model": 4})
    specs = {k: v.sharding_specs for k, v in course.mlp_layouts(mesh).items()}
    assert specs == {"w1": ["unsharded", "model"], "b1": ["model"],
                     "w2": ["model", "unsharded"], "b2": ["unsharded"]}
    swapped = {k: v.sharding_specs for k, v in course.mlp_layouts(mesh, wrong=True).items()}
    assert swapped == {"w1": ["model", "unsharded"], "b1": ["unsharded"],
                       "w2": ["unsharded", "model"], "b2": ["model"]}
    assert course.MEGATRON_WEAK_SCALING == {1: (1.2, 100.0), 2: (2.0, 90.7), 4: (4.2, 86.5),
                                            8: (8.7, 79.6)}


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_counted_bytes_ring_and_sequence_parallel_by_hand(four_devices, kind):
    """n = 4: a ring all-reduce sends 2 (n - 1) / n of the activation, half the direct one's
    (n - 1); sequence parallelism sends the ring's bytes plus the all-reduce (direct) of the
    replicated parameters' gradients: b2 for the MLP, b2, bo and two LayerNorms (6 h) for the
    block (Korthikanti et al. 2022, section 4.2.2)."""
    n, per = 4, {"mlp": 2, "block": 4}[kind]
    activation = B * S * H * 4
    ring = course.counted_bytes(four_devices, n, kind, batch=B, seq=S, hidden=H, heads=HEADS,
                                algorithm="ring")
    assert ring["counted_min"] == ring["counted_max"] == ring["formula"] \
        == per * 2 * 3 * activation // 4
    sp = course.counted_bytes(four_devices, n, kind, batch=B, seq=S, hidden=H, heads=HEADS,
                              sequence_parallel=True)
    params = {"mlp": 1, "block": 6}[kind] * H * 4
    assert sp["counted_min"] == sp["counted_max"] == sp["formula"] \
        == ring["formula"] + (n - 1) * params
    with pytest.raises(ValueError, match="seq=6 is not divisible by n=4 devices"):
        course.counted_bytes(four_devices, n, kind, batch=B, seq=6, hidden=H, heads=HEADS,
                             sequence_parallel=True)


def test_sequence_parallel_figure_labels_the_mlp_by_columns():
    import matplotlib.pyplot as plt

    fig = course.figure_sequence_parallel()
    texts = [t.get_text() for t in fig.axes[0].texts]
    plt.close(fig)
    mlp = [t for t in texts if t.startswith("MLP")]
    attention = [t for t in texts if t.startswith("attention")]
    assert len(mlp) == len(attention) == 2  # one box per device
    assert all("columns" in t and "heads" not in t for t in mlp)
    assert all("heads" in t and "columns" not in t for t in attention)
