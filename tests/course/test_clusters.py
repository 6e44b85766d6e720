"""accel.course.clusters: the exercises' checks say "not answered yet" for the placeholders,
accept the right answers (the solutions, written out here) and refuse wrong ones; the byte
counts agree with the closed forms; the shared problem's reference is plain SGD."""

import pytest

from accel import models
from accel.costmodel.collectives import BUS_FACTORS
from accel.course import clusters


def test_exercise_1_which_updates_a_retry_leaves_wrong():
    assert clusters.check_idempotent(None) == "exercise 1: not answered yet"
    # twice moves SGD's weights twice, counts the examples twice and advances Adam's step and
    # moments twice; recording the step, a running minimum and a per-step log entry are the same
    # after one run or two
    assert clusters.not_idempotent() == {"a", "b", "e"}
    assert clusters.check_idempotent("abe").startswith("exercise 1: correct")
    assert clusters.check_idempotent({"E", "a", "b"}).startswith("exercise 1: correct")
    assert "not quite" in clusters.check_idempotent("ab")
    assert "not quite" in clusters.check_idempotent("abdef")
    with pytest.raises(ValueError, match="the updates are"):
        clusters.check_idempotent("az")


def test_link_bytes_against_the_closed_forms():
    m = 1200.0
    for n in (2, 3, 8):
        ring = clusters.link_bytes("ring", n, m)
        for node in ring.values():  # every worker sends and receives 2 (n-1)/n of the model
            assert node["sent"] == pytest.approx(BUS_FACTORS["all_reduce"](n) * m)
            assert node["received"] == pytest.approx(node["sent"])
        for s in (1, 2, 4):
            ps = clusters.link_bytes("ps", n, m, servers=s)
            assert ps["worker:0"] == {"sent": pytest.approx(m), "received": pytest.approx(m)}
            assert ps[f"ps:{s - 1}"]["received"] == pytest.approx(n * m / s)
            assert ps[f"ps:{s - 1}"]["sent"] == pytest.approx(n * m / s)
    for bad in (dict(scheme="tree", workers=2, nbytes=1), dict(scheme="ps", workers=0, nbytes=1),
                dict(scheme="ps", workers=2, nbytes=-1), dict(scheme="ring", workers=2,
                                                              nbytes=1, servers=2)):
        with pytest.raises(ValueError):
            clusters.link_bytes(**bad)


def test_exercise_2_ps_vs_ring_bytes():
    assert clusters.check_bandwidth(None) == "exercise 2: not answered yet"
    assert clusters.check_bandwidth((None, None, None)) == "exercise 2: not answered yet"
    # 16 workers x 4e9 bytes into one ps; a ring worker sends 2 * 15/16 * 4e9 = 7.5e9; 64e9 / S
    # <= 7.5e9 first holds at S = 9 (8 gives exactly 8e9)
    assert clusters.check_bandwidth((64e9, 7.5e9, 9)).startswith("exercise 2: correct")
    assert "servers" in clusters.check_bandwidth((64e9, 7.5e9, 8))
    assert "ring bytes" in clusters.check_bandwidth((64e9, 8e9, 9))
    with pytest.raises(ValueError, match="answer must be"):
        clusters.check_bandwidth((64e9, 7.5e9))


def test_problem_trains():
    p = clusters.problem(steps=3)
    assert len(p["batches"]) == 3 and len(p["batches"][0][0]) == 32
    assert models.max_difference(p["reference"], p["init"]) > 1e-3
