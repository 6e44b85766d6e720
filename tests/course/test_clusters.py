"""accel.course.clusters: the exercises' checks say "not answered yet" for the placeholders,
accept the right answers (the solutions, written out here) and refuse wrong ones; the byte
counts agree with the closed forms; the expected synchronous step time with stragglers agrees
with a simulation; the shared problem's reference is plain SGD."""


import numpy as np
import pytest

from accel import models
from accel.costmodel.collectives import BUS_FACTORS
from accel.course import clusters


def test_exercise_1_which_updates_a_retry_leaves_wrong():
    assert clusters.check_idempotent(None) == "exercise 1: not answered yet"
    # the retry of step 1 runs after steps 2 and 3, at weights that have moved: SGD and Adam
    # apply a further update, the count takes a batch twice, last_step goes back to 1 and the
    # per-step log gets step 1's loss at later weights; a maximum and a per-step flag end the
    # same whatever the order and however often a step runs
    assert clusters.not_idempotent() == {"a", "b", "c", "e", "g"}
    assert clusters.check_idempotent("abceg").startswith("exercise 1: correct")
    assert clusters.check_idempotent({"E", "a", "b", "c", "g"}).startswith("exercise 1: correct")
    assert "not quite" in clusters.check_idempotent("abe")  # the same call twice, back to back
    assert "not quite" in clusters.check_idempotent("abcdefg")
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


def test_colocated_servers_send_what_a_ring_sends():
    m = 1200.0
    for n in (2, 3, 8):
        colocated = clusters.link_bytes("ps", n, m, servers=n, colocated=True)
        assert sorted(colocated) == [f"machine:{i}" for i in range(n)]
        for node in colocated.values():  # (n-1)/n of the gradient out, (n-1)/n of the weights
            assert node["sent"] == pytest.approx(2 * (n - 1) / n * m)
            assert node["received"] == pytest.approx(node["sent"])
    with pytest.raises(ValueError, match="servers must be 4"):
        clusters.link_bytes("ps", 4, m, servers=2, colocated=True)
    with pytest.raises(ValueError, match="no servers"):
        clusters.link_bytes("ring", 4, m, colocated=True)


def test_exercise_2_ps_machines_and_colocated_bytes():
    assert clusters.check_bandwidth(None) == "exercise 2: not answered yet"
    assert clusters.check_bandwidth((None, None)) == "exercise 2: not answered yet"
    # a ring worker sends 2 * 15/16 * 4e9 = 7.5e9; S dedicated servers each receive 64e9 / S,
    # <= 7.5e9 first at S = 9 (8 gives 8e9); colocated, each machine sends 15/16 of its gradient
    # to the other shards and 15 copies of its 1/16 of the weights: 7.5e9, a ring worker's bytes
    assert clusters.check_bandwidth((9, 7.5e9)).startswith("exercise 2: correct")
    assert "ps machines" in clusters.check_bandwidth((8, 7.5e9))
    assert "colocated bytes" in clusters.check_bandwidth((9, 8e9))
    with pytest.raises(ValueError, match="answer must be"):
        clusters.check_bandwidth((9, 7.5e9, 1))


def test_sync_step_time_against_a_simulation():
    # independent: draw every worker's step time and take the aggregate-th fastest
    rng = np.random.default_rng(0)
    slow = rng.random((200_000, 16)) < 0.01
    times = np.where(slow, 3.0, 1.0)
    for aggregate in (16, 15, 14):
        simulated = np.sort(times, axis=1)[:, aggregate - 1].mean()
        assert clusters.sync_step_time(16, aggregate, 1.0, 3.0, 0.01) == pytest.approx(
            simulated, rel=5e-3)
    assert clusters.sync_step_time(4, 4, 1.0, 3.0, 0.0) == 1.0
    assert clusters.sync_step_time(4, 1, 1.0, 3.0, 1.0) == 3.0
    for bad in ((4, 5, 1.0, 3.0, 0.1), (4, 0, 1.0, 3.0, 0.1), (4, 4, 1.0, 3.0, 1.5),
                (4, 4, 3.0, 1.0, 0.1)):
        with pytest.raises(ValueError):
            clusters.sync_step_time(*bad)


def test_exercise_3_backup_workers():
    assert clusters.check_backup(None) == "exercise 3: not answered yet"
    assert clusters.check_backup((None, None, None)) == "exercise 3: not answered yet"
    # by hand: all 16 wait for the slowest: 1 + 2 * (1 - 0.99^16) = 1.2971 s; the first 15 are
    # late only if two or more straggle: 1 + 2 * (1 - 0.99^16 - 16 * 0.01 * 0.99^15) = 1.0219 s;
    # gradients per second: (15 / 1.0219) / (16 / 1.2971) = 1.190
    every = 1 + 2 * (1 - 0.99 ** 16)
    backup = 1 + 2 * (1 - 0.99 ** 16 - 16 * 0.01 * 0.99 ** 15)
    assert (round(every, 4), round(backup, 4)) == (1.2971, 1.0219)
    ratio = (15 / backup) / (16 / every)
    assert clusters.check_backup((every, backup, ratio)).startswith("exercise 3: correct")
    assert clusters.check_backup((1.297, 1.022, 1.19)).startswith("exercise 3: correct")
    assert "first 15" in clusters.check_backup((1.297, 1.0, 1.19))
    assert "ratio" in clusters.check_backup((1.297, 1.022, 1.27))
    with pytest.raises(ValueError, match="answer must be"):
        clusters.check_backup((1.297, 1.022))


def test_problem_trains():
    p = clusters.problem(steps=3)
    assert len(p["batches"]) == 3 and len(p["batches"][0][0]) == 32
    assert models.max_difference(p["reference"], p["init"]) > 1e-3
