"""``MultiWorkerMirroredStrategy`` as real processes: training, input across workers, recovery.

Each worker is ``python -m accel.distributed.strategies worker SPEC`` with only ``TF_CONFIG``
set (what a reader runs on each machine). One worker process does, in this order:

* **input report** (``shard_files`` in the spec): what each worker reads from
  ``distribute_datasets_from_function`` (its ``InputContext``: ``num_input_pipelines``,
  ``input_pipeline_id``, ``get_per_replica_batch_size``) and from
  ``experimental_distribute_dataset`` over text files with each ``AutoShardPolicy`` (FILE:
  whole files per worker; DATA: every worker reads every file and keeps every n-th per-replica
  batch; OFF: everyone reads everything).
* **training**: a custom loop, SGD on the model of ``accel.models``; global batch ``s`` is batch
  ``s`` of the spec (data chosen by step number) and worker ``i`` takes slice ``i`` of it; the
  gradients are summed by the RING collective. With op determinism on, the run is bitwise
  reproducible. With ``checkpoint_dir`` a ``tf.train.CheckpointManager`` saves every ``every``
  steps (the chief into the directory, the others into their own sub-directories, as TensorFlow
  asks) and a restarted worker resumes from the chief's latest checkpoint.

``run_workers`` starts the processes and returns their JSON reports; ``pause_at`` makes the last
worker stop after that step, so that the caller can kill it (``fault_tolerant_run`` does: the
survivor's next all-reduce fails after ``timeout_seconds``, then both restart from the last
checkpoint).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

from accel import checks, models, training
from accel.distributed.cluster import make_cluster, parse_tf_config, tf_config
from accel.procs import ChildFailed, report_and_linger, start_python, wait_for_reports

__all__ = ["POLICIES", "run_workers", "fault_tolerant_run", "write_shard_files",
           "shard_rows_by_hand"]

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
        for c in children:
            c.stop()
        os.unlink(f.name)


def fault_tolerant_run(init: list[np.ndarray], batches: list, learning_rate: float, every: int,
                       kill_after: int, timeout_seconds: float = 5.0, hang: bool = False,
                       host: str = "127.0.0.1", timeout: float = 240.0) -> dict:
    """Two workers checkpointing every ``every`` steps; the second is killed after step
    ``kill_after`` (``hang=True``: frozen instead, killed later); the survivor's report says
    how its next collective failed; then both start again on the same addresses, resume from
    the last checkpoint and finish.
    Returns ``{"failure": ..., "resumed_from": step, "params": [weights of each worker]}``."""
    checks.positive_int("every", every)
    cluster = make_cluster(ps=0, workers=2, host=host)
    with tempfile.TemporaryDirectory() as ckpt:
        first = run_workers(init, batches, learning_rate, checkpoint_dir=ckpt, every=every,
                            pause_at=kill_after, hang=hang, timeout_seconds=timeout_seconds,
                            timeout=timeout, cluster=cluster)
        second = run_workers(init, batches, learning_rate, checkpoint_dir=ckpt, every=every,
                             timeout_seconds=timeout_seconds, timeout=timeout, cluster=cluster)
    return {"failure": first[0].get("error"), "resumed_from": second[0]["start"],
            "params": [[np.array(p, np.float32) for p in r["params"]] for r in second]}


def _input_report(tf, strategy, files: list[str], index: int) -> dict:
    """What this worker's replica reads from each kind of distributed dataset."""
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


def _worker(spec: dict) -> dict:
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=spec["timeout_seconds"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    _, _, index = parse_tf_config(os.environ["TF_CONFIG"])
    n = strategy.num_replicas_in_sync
    report = {}
    if spec["shard_files"]:
        report["input"] = _input_report(tf, strategy, spec["shard_files"], index)
    with strategy.scope():
        params = [tf.Variable(np.array(p, np.float32)) for p in spec["init"]]
        step_var = tf.Variable(0, dtype=tf.int64)
    manager = None
    if spec["checkpoint_dir"]:
        checkpoint = tf.train.Checkpoint(params=params, step=step_var)
        chief_dir = spec["checkpoint_dir"]
        own_dir = chief_dir if index == 0 else os.path.join(chief_dir, f"worker_{index}")
        if tf.train.latest_checkpoint(chief_dir):
            checkpoint.restore(tf.train.latest_checkpoint(chief_dir))
        manager = tf.train.CheckpointManager(checkpoint, own_dir, max_to_keep=2)

    @tf.function
    def step(xb, yb, global_batch):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                pred = models.mlp_apply(params, xb)
                loss = tf.reduce_sum(training.squared_error(yb, pred)) / global_batch
            grads = tf.distribute.get_replica_context().all_reduce(
                "sum", tape.gradient(loss, params))
            for v, g in zip(params, grads, strict=True):
                v.assign_sub(spec["learning_rate"] * g)
        strategy.run(replica, (xb, yb))
        step_var.assign_add(1)

    report["start"] = start = int(step_var.numpy())
    for s in range(start, len(spec["x"])):
        xb, yb = np.array(spec["x"][s], np.float32), np.array(spec["y"][s], np.float32)
        part = len(xb) // n
        began = time.monotonic()
        try:
            step(xb[index * part:(index + 1) * part], yb[index * part:(index + 1) * part],
                 float(len(xb)))
        except tf.errors.OpError as exc:
            report["error"] = {"type": type(exc).__name__, "step": s + 1,
                               "seconds": round(time.monotonic() - began, 1)}
            break
        if manager is not None and spec["every"] and (s + 1) % spec["every"] == 0:
            manager.save(checkpoint_number=s + 1)
        if spec["pause_at"] == s + 1 and index == n - 1:
            print(f"paused {s + 1}", flush=True)
            time.sleep(3600)  # the caller kills this process now
    report["params"] = [p.numpy().tolist() for p in params]
    return report


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        raise SystemExit("usage: python -m accel.distributed.strategies worker SPEC")
    with open(sys.argv[2]) as spec_file:
        spec = json.load(spec_file)
    # waits to be stopped with the others, and exits without waiting for the threads a failed
    # collective leaves behind
    report_and_linger(_worker(spec))
