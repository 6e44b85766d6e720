"""accel.distributed.strategies: MultiWorkerMirroredStrategy in two processes equals one device
on the global batch; each worker reads what the sharding rule says; a killed worker stops the
survivor's step within the collective timeout, and a restart from the last checkpoint ends with
exactly the weights of the uninterrupted run."""

import numpy as np
import pytest

from accel import models
from accel.distributed import strategies as S
from accel.procs import ChildFailed

LR = 0.05


def live_children() -> set[int]:
    """Live (not zombie) descendants of this test process."""
    psutil = pytest.importorskip("psutil")
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}


@pytest.fixture(scope="module")
def uninterrupted(problem, tmp_path_factory):
    init, batches, _ = problem
    files = S.write_shard_files(str(tmp_path_factory.mktemp("shards")), files=4, records=4)
    return S.run_workers(init, batches, LR, shard_files=files, timeout=240)


@pytest.mark.slow
def test_two_workers_equal_one_device_and_each_other(problem, uninterrupted):
    _, _, ref = problem
    first, second = ([np.array(p, np.float32) for p in r["params"]] for r in uninterrupted)
    assert models.max_difference(first, second) == 0.0
    for a, r in zip(first, ref, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6 * np.max(np.abs(r)))


@pytest.mark.slow
@pytest.mark.parametrize("policy", S.POLICIES)
def test_each_worker_reads_what_the_policy_says(uninterrupted, policy):
    # global batch 4 over 2 workers: DATA shards the per-replica batches of 2
    seen = [r["input"][policy] for r in uninterrupted]
    assert seen == S.shard_rows_by_hand(policy, files=4, records=4, workers=2, batch=2)


@pytest.mark.slow
def test_input_context_and_distribute_datasets_from_function(uninterrupted):
    # 2 pipelines, ids 0 and 1, global batch 4 -> 2 per replica; each shards the line stream
    assert [r["input"]["context"] for r in uninterrupted] == [[2, 0, 2], [2, 1, 2]]
    assert [r["input"]["function"] for r in uninterrupted] == S.shard_rows_by_hand(
        "DATA", files=4, records=4, workers=2)


def test_shard_rows_by_hand_literal_tables():
    assert S.shard_rows_by_hand("FILE", 4, 2, 2) == [
        ["f0:0", "f0:1", "f2:0", "f2:1"], ["f1:0", "f1:1", "f3:0", "f3:1"]]
    assert S.shard_rows_by_hand("DATA", 2, 3, 2) == [
        ["f0:0", "f0:2", "f1:1"], ["f0:1", "f1:0", "f1:2"]]
    assert S.shard_rows_by_hand("DATA", 2, 4, 2, batch=2) == [
        ["f0:0", "f0:1", "f1:0", "f1:1"], ["f0:2", "f0:3", "f1:2", "f1:3"]]
    assert S.shard_rows_by_hand("OFF", 1, 2, 2) == [["f0:0", "f0:1"], ["f0:0", "f0:1"]]


@pytest.mark.slow
def test_killed_worker_then_restart_from_checkpoint_is_bitwise_the_uninterrupted_run(
        problem, uninterrupted):
    init, batches, _ = problem
    before = live_children()
    result = S.fault_tolerant_run(init, batches, LR, every=2, kill_after=3,
                                  timeout_seconds=5.0, timeout=240)
    assert live_children() == before  # every worker process of both runs has ended
    assert result["failure"]["step"] == 4  # the survivor's next step could not finish
    assert result["failure"]["type"] == "UnavailableError"  # the peer's process is gone
    assert result["resumed_from"] == 2  # the last checkpoint before the kill (every 2 steps)
    assert result["before"] == [1, 2, 3] and result["after"] == [3, 4, 5, 6]  # 3 ran twice
    assert result["ready_seconds"] > 0
    whole = [np.array(p, np.float32) for p in uninterrupted[0]["params"]]
    for params in result["params"]:
        for a, b in zip(params, whole, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_frozen_worker_ends_the_survivors_step_after_the_collective_timeout(
        problem, uninterrupted):
    init, batches, _ = problem
    before = live_children()
    # In some loaded suite runs (never alone: 14 of 14 passed, 4 beside two busy loops),
    # TensorFlow 2.21 itself crashed the survivor (SIGSEGV, exit -11) while aborting the
    # timed-out collective, before Python saw the error; once, both of two runs in a row
    # crashed. That crash is not this code's to fix: up to three runs, each but the last
    # allowed only that crash; anything else is a failure, and the run that ends must show the
    # timeout.
    for attempt in range(3):
        try:
            result = S.fault_tolerant_run(init, batches, LR, every=2, kill_after=3, hang=True,
                                          timeout_seconds=3.0, timeout=240)
            break
        except ChildFailed as exc:
            if "exited (code -11)" not in str(exc) or attempt == 2:
                raise
    assert live_children() == before  # the frozen worker was ended too
    assert result["failure"]["type"] == "DeadlineExceededError"
    assert result["failure"]["step"] == 4
    assert result["failure"]["seconds"] >= 3.0  # a bound on the wait: the timeout, not sooner
    whole = [np.array(p, np.float32) for p in uninterrupted[0]["params"]]
    for params in result["params"]:
        assert models.max_difference(params, whole) == 0.0


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="every=2 needs a checkpoint_dir"):
        S.run_workers([], [(0, 0)] * 3, LR, every=2)
    with pytest.raises(ValueError, match="pause_at must be a step in 1..2, got 3"):
        S.run_workers([], [(0, 0)] * 3, LR, pause_at=3)
    with pytest.raises(ValueError, match="policy"):
        S.shard_rows_by_hand("ROWS", 1, 1, 1)
    with pytest.raises(ValueError, match="batch must be"):
        S.shard_rows_by_hand("DATA", 1, 1, 1, batch=0)
    with pytest.raises(ValueError, match="workers"):
        S.run_workers([], [], LR, workers=0)
    with pytest.raises(ValueError, match="timeout_seconds"):
        S.run_workers([], [], LR, timeout_seconds=0)
    with pytest.raises(ValueError, match="needs a chief task"):
        S.parameter_server_run(type("Cluster", (), {"cluster": {"worker": ["a"]}, "skip": []})(),
                               [], [], LR)


@pytest.mark.slow
def test_parameter_server_with_one_worker_is_one_device_and_records_its_batches(problem):
    from accel.distributed import cluster as C

    init, batches, ref = problem
    with C.LocalCluster(ps=1, workers=1, chief=True, skip=[("chief", 0)]) as cluster:
        run = S.parameter_server_run(cluster, init, batches, LR)
    assert run["taken"] == [(0, s) for s in range(1, len(batches) + 1)]
    assert run["scheduled"] == run["updates"] == len(batches)
    for a, r in zip(run["params"], ref, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6 * np.max(np.abs(r)))


@pytest.mark.slow
def test_parameter_server_with_two_workers_each_reads_its_own_copy_from_the_start(problem):
    from accel.distributed import cluster as C

    init, batches, _ = problem
    with C.LocalCluster(ps=1, workers=2, chief=True, skip=[("chief", 0)]) as cluster:
        run = S.parameter_server_run(cluster, init, batches, LR)
    assert len(run["taken"]) == run["scheduled"] == len(batches)
    assert {w for w, _ in run["taken"]} <= {0, 1}
    for w in (0, 1):  # every worker's own iterator: batches 1, 2, ... in order
        mine = [b for v, b in run["taken"] if v == w]
        assert mine == list(range(1, len(mine) + 1))
    assert run["updates"] <= run["scheduled"]  # Keras 3's assign_add: a read, then an assign


def test_stop_workers_ends_a_child_that_ignores_sigterm_with_sigkill():
    # an MWMS worker catches SIGTERM (its preemption notifier); a child doing the same
    import signal
    import time

    from accel.procs import start_python

    child = start_python(["-c", "import signal, time\n"
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                "print('ready', flush=True)\n"
                                "time.sleep(120)"], name="stubborn", warm=False)
    try:
        for _ in range(600):  # up to a minute for the child to start
            if "ready" in child.output()[0]:
                break
            assert child.alive()
            time.sleep(0.1)
    finally:
        S.stop_workers([child])
    assert child.popen.returncode == -signal.SIGKILL


def test_input_report_refuses_no_files():
    with pytest.raises(ValueError, match="files must be a non-empty list"):
        S.input_report(None, [])
    with pytest.raises(ValueError, match="files must be a non-empty list"):
        S.input_report(None, "f0.txt")
