"""``MultiWorkerMirroredStrategy`` as real processes: training, input across workers, recovery.

Each worker is ``python -m accel.distributed.strategies worker SPEC`` with only ``TF_CONFIG``
set (what a reader runs on each machine). One worker process does, in this order:

* **input report** (``shard_files`` in the spec): what each worker reads from
  ``distribute_datasets_from_function`` (its ``InputContext``: ``num_input_pipelines``,
  ``input_pipeline_id``, ``get_per_replica_batch_size``) and from
  ``experimental_distribute_dataset`` over text files with each ``AutoShardPolicy`` (FILE:
  whole files per worker; DATA: every worker reads every file and keeps every n-th per-replica
  batch; OFF: everyone reads everything).
* **training**: ``accel.parallel.strategies.train_loop``, the one loop of chapter 14, on the Keras
  form of the MLP of ``accel.models``; global batch ``s`` is batch ``s`` of the spec (data chosen
  by step number), every worker holds all of it and auto-sharding by DATA gives worker ``i``
  slice ``i``; the RING collective sums the gradients. With op determinism on, the run is
  bitwise reproducible. With ``checkpoint_dir`` the loop saves every ``every`` steps (the chief
  into the directory, the others into their own sub-directories, as TensorFlow asks) and a
  restarted worker resumes from the chief's latest checkpoint.

The ``coordinator`` entry point runs the same ``train_loop`` under ``ParameterServerStrategy``
(``parameter_server_run``): the loop schedules each step onto the cluster's workers.

``run_workers`` starts the processes and returns their JSON reports; ``pause_at`` makes the last
worker stop after that step, so that the caller can kill it (``fault_tolerant_run`` does: the
survivor's next all-reduce fails at once, since the dead peer's connections are closed, or, for
a frozen peer, after ``timeout_seconds``; then both restart from the last checkpoint).
``input_report`` is the input part, callable from any worker script; ``stop_workers`` ends
worker processes once they have reported (SIGKILL: a worker catches SIGTERM).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

from accel import checks, models
from accel.distributed.cluster import make_cluster, parse_tf_config, tf_config
from accel.procs import ChildFailed, report_and_linger, start_python, wait_for_reports

__all__ = ["POLICIES", "run_workers", "fault_tolerant_run", "parameter_server_run",
           "write_shard_files", "shard_rows_by_hand", "input_report", "stop_workers"]

POLICIES = ("FILE", "DATA", "OFF")


def write_shard_files(directory: str, files: int = 4, records: int = 4) -> list[str]:
    """``files`` text files ``f{i}.txt`` of ``records`` lines ``"f{i}:{r}"`` in ``directory``."""
    checks.positive_int("files", files)
    checks.positive_int("records", records)
    paths = []
    for i in range(files):
        path = os.path.join(directory, f"f{i}.txt")
        with open(path, "w") as f:
            f.write("".join(f"f{i}:{r}\n" for r in range(records)))
        paths.append(path)
    return paths


def shard_rows_by_hand(policy: str, files: int, records: int, workers: int,
                       batch: int = 1) -> list[list[str]]:
    """What each worker reads under ``policy``, worked out from the rule alone (the reference
    the processes' report is compared with). The stream is the files' records in order, cut
    into pieces of ``batch`` records (the per-replica batch): FILE gives worker ``i`` whole files
    ``i, i+n, ...``; DATA gives it pieces ``i, i+n, ...``; OFF gives it everything."""
    checks.one_of("policy", policy, POLICIES)
    for name, value in (("files", files), ("records", records), ("workers", workers),
                        ("batch", batch)):
        checks.positive_int(name, value)
    stream = [f"f{i}:{r}" for i in range(files) for r in range(records)]
    if policy == "OFF":
        return [stream] * workers
    if policy == "DATA":
        pieces = [stream[k:k + batch] for k in range(0, len(stream), batch)]
        return [[r for piece in pieces[w::workers] for r in piece] for w in range(workers)]
    return [[f"f{i}:{r}" for i in range(w, files, workers) for r in range(records)]
            for w in range(workers)]


def stop_workers(children) -> None:
    """End ``MultiWorkerMirroredStrategy`` worker processes at once (SIGKILL), once every one has
    reported. SIGTERM does not end such a worker: with the coordination service on, TensorFlow
    starts a preemption notifier that catches SIGTERM and records it as a preemption notice for
    the cluster (``tensorflow/core/common_runtime/eager/context_distributed_manager.cc``,
    ``PreemptionNotifier::CreatePreemptionNotifier("sigterm", ...)``), so a polite stop would
    only wait out its grace period."""
    for child in children:
        child.stop(grace=0.0)


def _spec(init, batches, learning_rate, **extra) -> dict:
    return {"init": [p.tolist() for p in init], "x": [b[0].tolist() for b in batches],
            "y": [b[1].tolist() for b in batches], "learning_rate": learning_rate, **extra}


def run_workers(init: list[np.ndarray], batches: list, learning_rate: float, workers: int = 2,
                host: str = "127.0.0.1", checkpoint_dir: str | None = None, every: int = 0,
                shard_files: list[str] | None = None, pause_at: int | None = None,
                hang: bool = False, timeout_seconds: float = 5.0, timeout: float = 180.0,
                cluster: dict | None = None) -> list[dict]:
    """Train with ``MultiWorkerMirroredStrategy`` in ``workers`` processes; each one's report
    (``params``, ``start`` = the step it began at, ``input`` when ``shard_files`` is given, or
    ``error`` = ``{"type", "step", "seconds"}`` when a collective failed).

    ``pause_at=k``: the last worker stops after step ``k``; it is killed here at once, or with
    ``hang=True`` left frozen until the others have finished (then killed).
    ``timeout_seconds`` bounds every collective (``CommunicationOptions``); ``timeout`` bounds
    the whole run (the processes are always ended)."""
    checks.positive_int("workers", workers)
    checks.non_negative_int("every", every)
    checks.positive_number("timeout_seconds", timeout_seconds)
    if every and checkpoint_dir is None:
        raise ValueError(f"every={every} needs a checkpoint_dir to save into")
    if pause_at is not None and not (isinstance(pause_at, int) and 0 < pause_at < len(batches)):
        raise ValueError(f"pause_at must be a step in 1..{len(batches) - 1}, got {pause_at!r}")
    cluster = cluster or make_cluster(ps=0, workers=workers, host=host)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(_spec(init, batches, learning_rate, checkpoint_dir=checkpoint_dir, every=every,
                        shard_files=shard_files, pause_at=pause_at,
                        timeout_seconds=timeout_seconds), f)
    deadline = time.monotonic() + timeout
    children = [start_python(["-m", "accel.distributed.strategies", "worker", f.name],
                             env={"TF_CONFIG": tf_config(cluster, "worker", w)},
                             name=f"worker:{w}") for w in range(workers)]
    try:
        if pause_at is not None:
            victim = children[-1]
            while f"paused {pause_at}" not in victim.output()[0]:
                if not victim.alive() or time.monotonic() > deadline:
                    raise ChildFailed(f"{victim.name} never reached step {pause_at}:\n"
                                      f"{victim.output()[1][-1500:]}")
                time.sleep(0.05)
            if not hang:
                victim.stop(grace=0.0)
            return wait_for_reports(children[:-1], max(deadline - time.monotonic(), 0.1))
        return wait_for_reports(children, max(deadline - time.monotonic(), 0.1))
    finally:
        stop_workers(children)
        os.unlink(f.name)


def fault_tolerant_run(init: list[np.ndarray], batches: list, learning_rate: float, every: int,
                       kill_after: int, timeout_seconds: float = 5.0, hang: bool = False,
                       host: str = "127.0.0.1", timeout: float = 240.0) -> dict:
    """Two workers checkpointing every ``every`` steps; the second is killed after step
    ``kill_after`` (``hang=True``: frozen instead, killed later); the survivor's report says
    how its next collective failed; then both start again on the same addresses, resume from
    the last checkpoint and finish.
    Returns ``{"failure": ..., "resumed_from": step, "params": [weights of each worker],
    "before": steps the survivor completed before the failure, "after": steps of the restarted
    run, "ready_seconds": from a restarted worker's start to the end of its first step}``."""
    checks.positive_int("every", every)
    cluster = make_cluster(ps=0, workers=2, host=host)
    with tempfile.TemporaryDirectory() as ckpt:
        first = run_workers(init, batches, learning_rate, checkpoint_dir=ckpt, every=every,
                            pause_at=kill_after, hang=hang, timeout_seconds=timeout_seconds,
                            timeout=timeout, cluster=cluster)
        second = run_workers(init, batches, learning_rate, checkpoint_dir=ckpt, every=every,
                             timeout_seconds=timeout_seconds, timeout=timeout, cluster=cluster)
    return {"failure": first[0].get("error"), "resumed_from": second[0]["start"],
            "params": [[np.array(p, np.float32) for p in r["params"]] for r in second],
            "before": first[0]["steps"], "after": second[0]["steps"],
            "ready_seconds": max(r["ready_seconds"] for r in second)}


def input_report(strategy, files: list[str]) -> dict:
    """What this worker's replica reads from each kind of distributed dataset over ``files``
    (``write_shard_files``), with a global batch of 2 per replica: ``"context"``, this worker's
    ``[num_input_pipelines, input_pipeline_id, per-replica batch]`` from
    ``distribute_datasets_from_function``; ``"function"``, the records that function's
    ``shard(...)`` pipeline gave it; ``"FILE"``, ``"DATA"``, ``"OFF"``, the records
    ``experimental_distribute_dataset`` gave it under that ``AutoShardPolicy``. Call it in every
    worker of a ``MultiWorkerMirroredStrategy`` (it runs collectives)."""
    import tensorflow as tf

    if isinstance(files, str) or not files:
        raise ValueError(f"files must be a non-empty list of paths, got {files!r}")
    global_batch = 2 * strategy.num_replicas_in_sync
    seen = {}

    def from_context(ctx):
        seen["context"] = [ctx.num_input_pipelines, ctx.input_pipeline_id,
                           ctx.get_per_replica_batch_size(global_batch)]
        lines = tf.data.TextLineDataset(files).shard(ctx.num_input_pipelines,
                                                     ctx.input_pipeline_id)
        return lines.batch(ctx.get_per_replica_batch_size(global_batch))

    def read(dist) -> list[str]:
        rows = []
        for batch in dist:
            rows += [b.decode() for b in strategy.experimental_local_results(batch)[0].numpy()]
        return rows

    report = {"function": read(strategy.distribute_datasets_from_function(from_context))}
    report["context"] = seen["context"]
    for name in POLICIES:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(
            tf.data.experimental.AutoShardPolicy, name)
        lines = tf.data.Dataset.from_tensor_slices(files).interleave(
            tf.data.TextLineDataset, cycle_length=1)
        dist = strategy.experimental_distribute_dataset(
            lines.batch(global_batch).with_options(options))
        report[name] = read(dist)
    return report


def _loop_args(spec: dict) -> dict:
    """``train_loop``'s arguments for the spec's global batches (data chosen by step number:
    the batches laid end to end, cut again in the same places) and its Keras MLP."""
    init = [np.array(p, np.float32) for p in spec["init"]]
    sizes = [init[0].shape[0]] + [w.shape[1] for w in init[::2]]

    def make_model():
        model = models.keras_mlp(sizes)
        model.set_weights(init)
        return model

    x, y = np.array(spec["x"], np.float32), np.array(spec["y"], np.float32)
    return {"make_model": make_model, "x": x.reshape(-1, x.shape[-1]),
            "y": y.reshape(-1, y.shape[-1]), "global_batch_size": x.shape[1],
            "steps": x.shape[0], "learning_rate": spec["learning_rate"]}


def _worker(spec: dict) -> dict:
    """One ``MultiWorkerMirroredStrategy`` worker: ``train_loop``, the chapter's one loop."""
    began = time.monotonic()
    import tensorflow as tf

    from accel.parallel.strategies import train_loop

    tf.config.experimental.enable_op_determinism()
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=spec["timeout_seconds"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    _, _, index = parse_tf_config(os.environ["TF_CONFIG"])
    report = {}
    if spec["shard_files"]:
        report["input"] = input_report(strategy, spec["shard_files"])
    last = {"step": 0, "time": time.monotonic()}
    steps: list[int] = []

    def after_step(s: int) -> None:
        if not steps:
            report["ready_seconds"] = round(time.monotonic() - began, 3)
        steps.append(s)
        last.update(step=s, time=time.monotonic())
        if spec["pause_at"] == s and index == strategy.num_replicas_in_sync - 1:
            print(f"paused {s}", flush=True)
            time.sleep(3600)  # the caller kills this process now

    args = _loop_args(spec)
    ckpt = spec["checkpoint_dir"]
    report["start"] = 0
    try:
        run = train_loop(strategy, **args, checkpoint_dir=ckpt, every=spec["every"],
                         after_step=after_step)
    except tf.errors.OpError as exc:
        report["error"] = {"type": type(exc).__name__, "step": last["step"] + 1,
                           "message": str(exc).splitlines()[0][:300],
                           "seconds": round(time.monotonic() - last["time"], 1)}
        report.update(params=[], steps=steps)
        return report
    report.update(start=run.start, params=[w.tolist() for w in run.weights],
                  losses=run.losses, steps=steps)
    return report


def _coordinator(spec: dict) -> dict:
    """The ``ParameterServerStrategy`` coordinator (the ``chief`` task): the same
    ``train_loop``, which schedules each step onto the workers."""
    import tensorflow as tf

    from accel.parallel.strategies import train_loop

    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver())
    run = train_loop(strategy, **_loop_args(spec))
    return {"params": [w.tolist() for w in run.weights], "losses": run.losses,
            "scheduled": len(run.losses), "updates": run.updates, "taken": run.taken}


def parameter_server_run(cluster, init: list[np.ndarray], batches: list, learning_rate: float,
                         timeout: float = 180.0) -> dict:
    """Train with ``ParameterServerStrategy`` on ``cluster`` (a running ``LocalCluster`` with a
    ``chief`` task it does not start itself: this starts it, as the coordinator process running
    ``train_loop``). Returns ``{"params", "losses", "scheduled", "updates", "taken"}``:
    ``updates`` is the optimizer's step counter, a variable on the ps; ``taken`` lists
    ``(worker, batch)`` for each scheduled step (``LoopResult.taken``)."""
    if "chief" not in cluster.cluster or ("chief", 0) not in cluster.skip:
        raise ValueError("the cluster needs a chief task that it does not start itself "
                         "(LocalCluster(chief=True, skip=[('chief', 0)])): the coordinator")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(_spec(init, batches, learning_rate), f)
    child = start_python(["-m", "accel.distributed.strategies", "coordinator", f.name],
                         env={"TF_CONFIG": tf_config(cluster.cluster, "chief", 0)},
                         name="the coordinator (chief:0)")
    try:
        report = wait_for_reports([child], timeout)[0]
    finally:
        stop_workers([child])  # the coordinator catches SIGTERM too (its coordination service)
        os.unlink(f.name)
    report["params"] = [np.array(p, np.float32) for p in report["params"]]
    report["taken"] = [tuple(t) for t in report["taken"]]
    return report


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("worker", "coordinator"):
        raise SystemExit("usage: python -m accel.distributed.strategies worker|coordinator SPEC")
    with open(sys.argv[2]) as spec_file:
        spec = json.load(spec_file)
    # waits to be stopped (with the others), and exits without waiting for the threads a failed
    # collective or the coordinator leaves behind
    report_and_linger((_worker if sys.argv[1] == "worker" else _coordinator)(spec))
