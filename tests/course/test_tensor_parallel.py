"""accel.course.tensor_parallel: the exercises' solutions, the steps agree with each other (never
their timings), and the figures draw."""

import numpy as np
import pytest

from accel.course import tensor_parallel as course
from accel.parallel import megatron as tp


def test_exercise_1_solution():
    # 3 blocks x 4 all-reduces x (4 - 1) x (2 * 16 * 64 * 4 bytes), worked out by hand
    assert course.check_stack_bytes(None).startswith("not yet")
    assert course.check_stack_bytes(294912).startswith("right")
    assert course.check_stack_bytes(98304).startswith("not quite")


def test_exercise_2_solution():
    assert course.check_hidden_for_pcie(None).startswith("not yet")
    assert course.check_hidden_for_pcie(10240).startswith("right")
    assert course.check_hidden_for_pcie(9216).startswith("not quite")
    assert course.check_hidden_for_pcie(11264).startswith("not quite")
    assert course.check_hidden_for_pcie(1000).startswith("not quite")


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

    for fig in (course.figure_sequence_parallel(), course.figure_tp_cost()):
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
