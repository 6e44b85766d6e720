"""Chapter 13's experiments: the exercises' solutions, TensorFlow's implementations on the
same tensors, bytes tables, and the all-reduce across real processes (slow)."""

import math

import numpy as np
import pytest

from accel import collectives
from accel.costmodel import collectives as cost
from accel.course import collectives as course
from accel.course import overlap, traffic


def test_exercise_solutions():
    assert course.check_exercise(1, None) == "exercise 1: not answered yet"
    # binomial, 3 devices: device 0 sends the total to 2, then to 1: 2 x 1 KiB
    assert course.check_exercise(1, 2048) == "exercise 1: correct (2048)"
    assert "too low" in course.check_exercise(1, 1024)
    # halving-doubling on 6 (folded: 6 alpha + 3.5 S/bw) = ring (10 alpha + 10/6 S/bw) at
    # S = 4 alpha bw / (3.5 - 10/6) = 4e5 / (11/6) = 218181.8
    assert course.check_exercise(2, 218181) == "exercise 2: correct (218181)"
    assert "too high" in course.check_exercise(2, 10 ** 9)
    assert course.check_exercise(3, 8) == "exercise 3: correct (8)"
    assert "too low" in course.check_exercise(3, 4)
    assert course.check_exercise(4, None) == "exercise 4: not answered yet"
    assert course.check_exercise(4, ((1, 1), (10, 1))).startswith("exercise 4: correct")
    assert "not quite" in course.check_exercise(4, ((1, 1), (10, 10)))
    with pytest.raises(ValueError, match="number must be 1, 2, 3 or 4"):
        course.check_exercise(5, 1)


def test_exercise_4_answer_is_what_the_packs_show(four_devices):
    """Section 8's MLP on the four devices: the literal answer equals pack_order's count."""
    model = overlap.deep_mlp(four_devices, depth=4)
    x, y = overlap.deep_batch(model, batch=8)
    strategy = course.tf_strategy(tuple(four_devices), "collective")
    got = []
    for pack in (0, 1):
        packs = traffic.pack_order(traffic.pack_step(strategy, model, x, y, pack), model,
                                   four_devices[0])
        got.append((len(packs), sum("d0" in p.waits for p in packs)))
    assert tuple(got) == course.PACKS_FOR_0_AND_1


def test_tf_implementations_and_bytes_table(four_devices):
    xs = course.placed(four_devices, 9)
    exact = np.sum([np.float64(x.numpy()) for x in xs], axis=0)
    for name in course.TF_IMPLEMENTATIONS:
        for y in course.tf_all_reduce(name, xs, four_devices):
            np.testing.assert_allclose(y.numpy(), exact, rtol=1e-5, atol=1e-6 * abs(exact).max())
    with pytest.raises(ValueError, match="name must be one of"):
        course.tf_all_reduce("nccl", xs, four_devices)
    rows = course.bytes_table(four_devices, 9)
    assert [r[0] for r in rows] == list(collectives.ALGORITHMS)
    assert all(counted == formula for _, counted, formula in rows)
    assert rows[1][1] == [3 * 36, 36, 36, 36]  # through device 0: (n - 1) S, then S
    table = course.collective_bytes_table(four_devices, (2, 4), part=3)
    for name, n, _, _, factor in table:  # counted / S is nccl-tests' busbw factor
        assert factor == pytest.approx(cost.BUS_FACTORS[name](n)), name


@pytest.mark.slow  # several seconds: left to make test, out of make quick
def test_tf_packing_counts_the_collectives_tensorflow_launched(four_devices):
    """64 gradients of 1 KiB: bytes_per_pack=1 closes a pack after every tensor (64); 16 KiB
    closes one once it holds more than 16 KiB, i.e. 17 tensors (17, 17, 17, 13: 4); 0 is
    TF's default, one pack in a tf.function (1). Sums are checked against NumPy inside."""
    packed = traffic.tf_packing(four_devices, tensors=64, size=256, repeat=1)
    assert {p: calls for p, (_, calls) in packed.items()} == {1: 64, 16384: 4, 0: 1}
    assert all(t > 0 for t, _ in packed.values())


@pytest.mark.slow
def test_process_sweep_sums_correctly_and_ends_its_processes():
    """Both all-reduces (and the hand one_device) across 2 processes check their sums inside,
    after chained all-reduces (a wrong sum raises)."""
    result = course.sweep(2, [4096, 65536], repeat=1, timeout=200, chain=2,
                          others=("one_device",), rounds=2)
    assert result["sizes"] == [4096, 65536] and result["workers"] == 2
    assert result["chain"] == 2
    assert len(result["hand"]) == len(result["tf_ring"]) == 2
    assert len(result["others"]["one_device"]) == 2
    lines, ratios = course.process_lines(result)
    assert set(ratios) == {4096, 65536} and len(lines) == 5


def test_link_cases_are_cited_links():
    for link, alpha in course.LINK_CASES:
        spec = cost.link_spec(link)
        assert spec.value > 0 and spec.source and 0 < alpha < 1e-4


def test_crossover_lines_on_times_made_from_the_model():
    """Times made from the links model (n = 4, call 1 ms, alpha 1 ms, 100 MB/s): the fit finds
    it again, and both the predicted and the measured crossover land where the model puts
    them (tree vs ring: 2 alpha bw / 2.5 = 80 KB; the measured one interpolates between
    sizes, so within the grid's step)."""
    sizes = [2 ** k for k in range(10, 24)]
    model = {alg: [1e-3 + cost.allreduce_time(s, 4, alg, 1e-3, 1e8) for s in sizes]
             for alg in ("ring", "tree")}
    result = {"workers": 4, "sizes": sizes, "chain": 1, "hand": model["ring"],
              "others": {"tree": model["tree"]}}
    lines, checked = course.crossover_lines(result)
    fit, crossings = checked["links"]
    assert fit[:3] == pytest.approx((1e-3, 1e-3, 1e8))
    predicted, measured = crossings["tree"]
    assert predicted == pytest.approx(2e-3 * 1e8 / 2.5)
    assert measured == tuple(s for s in sizes if s < predicted) == (1024, 2048, 4096, 8192,
                                                                    16384, 32768, 65536)
    assert checked["shared"][1]["tree"][0] == math.inf  # fewer messages: never the ring
    assert any("predicted below 78.1 KiB (at 1 KiB, 2 KiB, 4 KiB, 8 KiB, 16 KiB, 32 KiB, "
               "64 KiB), measured at 1 KiB" in line and line.endswith(": agree")
               for line in lines)


def test_faster_sizes_lists_every_win_and_flags_flips():
    """A row that wins, loses, then wins again (a likely-noise row) is listed size by size
    and flagged, not read as a crossover at its first flip."""
    sizes = [4096, 262144, 4 << 20]
    assert course.faster_sizes(sizes, [1, 3, 1], [2, 2, 2]) == (4096, 4 << 20)
    assert course.faster_sizes(sizes[::-1], [1, 3, 1], [2, 2, 2]) == (4096, 4 << 20)
    assert course._fmt_sizes((4096, 4 << 20), sizes) == "at 4 KiB, 4 MiB (flips more than once)"
    assert course._fmt_sizes((4096,), sizes) == "at 4 KiB"
    assert course._fmt_sizes((), sizes) == "at no size"
    assert course._fmt_sizes(tuple(sizes), sizes) == "at every size"
    with pytest.raises(ValueError, match="equally many"):
        course.faster_sizes(sizes, [1], [2])
