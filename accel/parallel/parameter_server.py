"""A parameter server and its workers in one process: synchronous, asynchronous (with a lock, or
lock-free) and K-of-N training, stragglers, and a deterministic controlled-staleness loop.

The server holds the ``tf.Variable`` s on ``ps_device``. Each worker is a Python thread with its own
``tf.function`` on its device: it reads the parameters and their version, computes the gradient of
``loss_fn(y, model_fn(params, x))`` on its shard, and sends it back. What the server does with it
is the mode: ``sync`` waits for all N gradients of the current version, averages and applies once;
``k_of_n`` averages the first K and drops the late ones (backup workers, as
``tf.compat.v1.train.SyncReplicasOptimizer`` with ``replicas_to_aggregate``); ``async`` applies
each gradient on arrival, one at a time under the server's lock (asynchronous SGD as in Downpour
SGD, Dean et al. 2012); ``hogwild`` has no lock at all: every worker applies its own gradient to
the shared variables while others read and write them (Niu et al. 2011, run by
``accel.parallel.hogwild``); ``delayed`` has no threads: gradient ``g`` uses the parameters
``delay[g]`` versions old, so staleness can be studied deterministically. The decisions
themselves are the pure functions of ``accel.parallel.staleness``.

``steps`` counts applied updates (in ``delayed``: gradients, as some may be dropped); with
``target_loss`` a run stops earlier, at the first update that brings the full-data loss down to
the target, and ``race_to_target`` repeats such runs for several variants. Every
gradient leaves an ``UpdateRecord``; ``loss_fn`` returns per-example losses (``accel.training``).
A worker that raises stops the run; its exception is re-raised in the caller with a note naming
the worker, after every thread is joined.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.parallel.hogwild import pad_step, run_lock_free, run_workers
from accel.parallel.staleness import (
    MODES,
    SYNC_MODES,
    TrainResult,
    UpdateRecord,
    check_train_arguments,
    delayed_read_version,
    first_reach,
    may_read,
    race_summary,
    server_decision,
)
from accel.training import make_update

__all__ = ["MODES", "worker_batches", "train", "train_sync", "train_async", "train_hogwild",
           "train_k_of_n", "train_delayed", "race_to_target"]


def worker_batches(x, y, num_workers: int, batch_size: int) -> list[list[tuple]]:
    """Worker ``w``'s mini-batches: its contiguous ``1/num_workers`` shard cut into batches.

    Worker ``w`` uses ``batches[w][i % len(batches[w])]`` at its ``i``-th gradient.
    """
    checks.positive_int("num_workers", num_workers)
    checks.positive_int("batch_size", batch_size)
    per = len(x) // num_workers
    if per < batch_size or len(x) != len(y):
        raise ValueError(f"{len(x)} examples (labels: {len(y)}) cannot give {num_workers} "
                         f"workers a batch of {batch_size} each")
    return [[(x[w * per + j: w * per + j + batch_size], y[w * per + j: w * per + j + batch_size])
             for j in range(0, per - batch_size + 1, batch_size)] for w in range(num_workers)]


@functools.lru_cache(maxsize=64)  # one traced step per (model, loss, device)
def _grad_fn(model_fn: Callable, loss_fn: Callable, device: str):
    @tf.function(autograph=False)
    def grad_step(params, x, y):
        with tf.device(device):
            with tf.GradientTape() as tape:
                tape.watch(params)
                loss = tf.reduce_mean(loss_fn(y, model_fn(params, x)))
            return loss, tape.gradient(loss, params)

    return grad_step


@functools.lru_cache(maxsize=64)  # one traced full-data loss per (model, loss): not per run
def _loss_fn(model_fn: Callable, loss_fn: Callable):
    return tf.function(lambda p, xs, ys: tf.reduce_mean(loss_fn(ys, model_fn(p, xs))),
                       autograph=False)


class _Server:
    """Variables, version counter and the mode's update rule; all shared state under ``cond``."""

    def __init__(self, mode, params, ps_device, optimizer, k, max_staleness, eval_fn, eval_every,
                 steps, clock):
        with tf.device(ps_device):
            self.vars = [tf.Variable(np.asarray(p, np.float32)) for p in params]
        self.update = make_update(optimizer, self.vars, ps_device)
        self.mode, self.ps_device, self.k, self.max_staleness = mode, ps_device, k, max_staleness
        self.eval_fn, self.eval_every, self.clock = eval_fn, eval_every, clock
        self.cond = threading.Condition()
        self.version, self.steps, self.stopped, self.error = 0, steps, False, None
        self.records, self.pending, self.curve, self.examples, self.last_read = [], [], [], 0, {}
        self.curve_time = []
        self.t0 = clock()
        self.last_update = None
        self.staleness_lr = False
        self.target_loss = None

    def snapshot(self) -> list[tf.Tensor]:
        with tf.device(self.ps_device):
            return [tf.identity(v) for v in self.vars]

    def apply(self, grads, now: float) -> None:
        """Called under ``cond``: one update, a new version, maybe a loss sample or the end."""
        with tf.device(self.ps_device):
            self.update(list(zip(grads, self.vars, strict=True)))
        self.version += 1
        self.last_update = now
        if self.eval_every and self.version % self.eval_every == 0:
            loss = float(self.eval_fn(self.snapshot()))
            self.curve.append((self.examples, loss))
            self.curve_time.append(now)
            if self.target_loss is not None and loss <= self.target_loss:
                self.stopped = True
        if self.version >= self.steps:
            self.stopped = True
        self.cond.notify_all()

    def receive(self, worker, step, read_version, loss, grads, examples) -> None:
        """Called under ``cond`` when a gradient arrives: ``server_decision`` says what to do."""
        if self.stopped:
            return
        now = self.clock() - self.t0
        record = dict(worker=worker, read_version=read_version, applied_version=self.version,
                      loss=loss, time=now, examples=examples, step=step)
        if self.mode in SYNC_MODES:
            self.last_read[worker] = read_version
        decision = server_decision(self.mode, self.version, read_version, len(self.pending),
                                   self.k, self.max_staleness)
        if decision == "drop":
            self.records.append(UpdateRecord(**record, dropped=True))
            return
        if self.mode not in SYNC_MODES:
            self.records.append(UpdateRecord(**record))
            self.examples += examples
            stale = self.version - read_version
            if self.staleness_lr and stale > 1:  # SGD: lr / tau is the gradient / tau
                grads = [g / float(stale) for g in grads]
            return self.apply(grads, now)
        self.pending.append((worker, record, grads))
        if decision == "apply":
            self.pending.sort(key=lambda item: item[0])  # a fixed order of the sum
            with tf.device(self.ps_device):
                grads = zip(*(p[2] for p in self.pending), strict=True)
                mean = [tf.add_n(list(gs)) / self.k for gs in grads]
            self.records.extend(UpdateRecord(**p[1]) for p in self.pending)
            self.examples += sum(p[1]["examples"] for p in self.pending)
            self.pending = []
            self.apply(mean, now)

    def may_read(self, worker: int, warmup_steps: int) -> bool:
        return may_read(self.mode, self.version, self.last_read.get(worker, -1), worker,
                        warmup_steps)


def _worker_loop(server: _Server, w: int, fn, batches, step_time, factor, warmup_steps) -> None:
    i = 0
    try:
        while True:
            with server.cond:
                server.cond.wait_for(lambda: server.stopped or server.may_read(w, warmup_steps))
                if server.stopped:
                    return
                read_version, params = server.version, server.snapshot()
            start = time.perf_counter()
            xb, yb = batches[i % len(batches)]
            loss, grads = fn(params, xb, yb)
            loss = float(loss)  # waits for the step to finish (GPUs return early)
            pad_step(start, step_time, factor)
            with server.cond:
                server.receive(w, i, read_version, loss, grads, int(xb.shape[0]))
            i += 1
    except BaseException as exc:  # handed to the caller, which re-raises it
        with server.cond:
            if server.error is None:
                server.error = (w, exc)
            server.stopped = True
            server.cond.notify_all()


def _run_threads(server, fns, batches, workers, step_time, slowdown, warmup_steps) -> None:
    def stop():
        with server.cond:
            server.stopped = True
            server.cond.notify_all()

    run_workers(_worker_loop, [(server, w, fns[w], batches[w], step_time, slowdown.get(w, 1.0),
                                warmup_steps) for w in range(len(workers))],
                stop=stop, failed=lambda: server.error,
                note=lambda w: f"raised by parameter-server worker {w} on {workers[w]}")


def _run_delayed(server, fns, batches, delays, warmup_steps) -> None:
    snapshots = {0: server.snapshot()}
    for g, delay in enumerate(delays):
        w, step = g % len(fns), g // len(fns)
        read = delayed_read_version(server.version, delay, g, warmup_steps)
        xb, yb = batches[w][step % len(batches[w])]
        loss, grads = fns[w](snapshots[read], xb, yb)
        with server.cond:
            server.receive(w, step, read, float(loss), grads, int(xb.shape[0]))
        if server.stopped:
            return
        if server.version not in snapshots:
            snapshots[server.version] = server.snapshot()
            snapshots.pop(server.version - max(delays) - 1, None)


def train(mode: str, model_fn: Callable, loss_fn: Callable, params: Sequence[np.ndarray], x, y,
          workers: Sequence[str], *, steps: int, batch_size: int = 32,
          optimizer: float | object = 0.1, ps_device: str = "/device:CPU:0", k: int | None = None,
          delay: int | Sequence[int] | None = None, slowdown: Mapping[int, float] | None = None,
          step_time: float = 0.0, max_staleness: int | None = None, warmup_steps: int = 0,
          staleness_lr: bool = False, eval_every: int = 0, target_loss: float | None = None,
          clock: Callable[[], float] = time.perf_counter) -> TrainResult:
    """Train ``model_fn(params, x)`` from the initial ``params`` in ``mode`` (see ``MODES``).

    ``workers``: one device per worker; ``steps``: updates to apply; ``optimizer``: a learning
    rate (plain SGD) or an optimizer (``accel.training.make_update``; not in ``hogwild``).
    ``k``: gradients per update in ``k_of_n``. ``delay``: staleness per gradient in ``delayed``
    (an int or a list).
    ``slowdown``: ``{worker: factor}`` makes those workers' steps ``factor`` times longer;
    ``step_time``: pad every step to at least this many seconds (a device's compute time, since
    virtual CPUs share cores). Mitigations: ``max_staleness`` drops staler gradients;
    ``warmup_steps``: the first updates come from worker 0 alone (async) / without delay;
    ``staleness_lr``: a gradient ``tau`` updates stale is applied with the learning rate divided
    by ``tau`` (Zhang, Gupta, Lian & Liu 2016, staleness-aware async SGD; plain SGD only).
    ``eval_every``: sample the full-data loss every that many updates into ``result.curve``
    (and the seconds since the start into ``result.curve_time``). ``target_loss``: sample the
    full-data loss after every update (as ``eval_every=1``, under the server's lock, so every
    update pays for it on the run's clock) and stop at the first one at or below the target;
    ``steps`` stays the limit (``staleness.first_reach`` reads the result).
    ``clock``: the time source of the records and of ``wall_time`` (start to last applied
    update). An argument the mode does not use is a ``ValueError`` naming the modes that use it.
    """
    delays = check_train_arguments(mode, len(workers), steps, k, delay, slowdown, step_time,
                                   max_staleness, optimizer, warmup_steps, eval_every,
                                   staleness_lr, target_loss)
    eval_every = 1 if target_loss is not None else eval_every
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    batches = worker_batches(x, y, len(workers), batch_size)
    fns = [_grad_fn(model_fn, loss_fn, dev) for dev in workers]
    eval_fn = functools.partial(_loss_fn(model_fn, loss_fn), xs=x, ys=y)
    k = {"sync": len(workers), "k_of_n": k}.get(mode, 1)
    server = _Server(mode, params, ps_device, optimizer, k, max_staleness, eval_fn, eval_every,
                     steps, clock)
    server.staleness_lr, server.target_loss = staleness_lr, target_loss
    if eval_every and mode != "hogwild":
        server.curve.append((0, float(eval_fn(server.snapshot()))))
        server.curve_time.append(0.0)
        server.stopped = target_loss is not None and server.curve[0][1] <= target_loss
        server.t0 = clock()
    if mode == "hogwild":
        run = run_lock_free(server.vars, server.update, fns, batches, steps=steps,
                            step_time=step_time, slowdown=dict(slowdown or {}), eval_fn=eval_fn,
                            eval_every=eval_every, clock=clock)
        return TrainResult(mode, [v.numpy() for v in server.vars], run["records"],
                           run["wall_time"], float(eval_fn(server.snapshot())), run["curve"],
                           run["curve_time"], run["update_spans"], run["read_spans"])
    if mode == "delayed":
        _run_delayed(server, fns, batches, delays, warmup_steps)
    else:
        _run_threads(server, fns, batches, list(workers), step_time, dict(slowdown or {}),
                     warmup_steps)
    wall = server.last_update if server.last_update is not None else clock() - server.t0
    final = float(eval_fn(server.snapshot()))
    return TrainResult(mode, [v.numpy() for v in server.vars], server.records, wall, final,
                       server.curve, server.curve_time)


def train_sync(*args, **kwargs) -> TrainResult:
    """``train("sync", ...)``: every update averages one gradient from each worker."""
    return train("sync", *args, **kwargs)


def train_k_of_n(*args, k: int, **kwargs) -> TrainResult:
    """``train("k_of_n", ..., k=k)``: every update averages the first ``k`` fresh gradients."""
    return train("k_of_n", *args, k=k, **kwargs)


def train_async(*args, **kwargs) -> TrainResult:
    """``train("async", ...)``: every gradient is applied as soon as it arrives, one at a time
    under the server's lock (Downpour-style asynchronous SGD)."""
    return train("async", *args, **kwargs)


def train_hogwild(*args, **kwargs) -> TrainResult:
    """``train("hogwild", ...)``: every worker applies its gradient itself, with no lock (plain
    SGD: ``optimizer`` must be a learning rate)."""
    return train("hogwild", *args, **kwargs)


def train_delayed(*args, delay: int | Sequence[int], **kwargs) -> TrainResult:
    """``train("delayed", ..., delay=delay)``: gradient ``g`` reads parameters ``delay`` (or
    ``delay[g]``) versions old; deterministic, no threads."""
    return train("delayed", *args, delay=delay, **kwargs)


def race_to_target(variants: Mapping[str, Mapping], *, target_loss: float, repeats: int,
                   baseline: str, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Time to a target loss: run every variant ``repeats`` times until its full-data loss
    reaches ``target_loss`` and compare them.

    ``variants[name]`` holds ``train``'s keyword arguments, ``mode`` included (``steps`` is the
    limit of a run that does not get there). Every variant gets the same warm-up, one untimed
    run of one update (each worker's step traced, the server's code paths run once), and the
    same ``clock``. Repetitions are interleaved, one run of every variant per repetition, the
    order rotated by one each time, so that a slow spell of the machine is shared out rather
    than landing on one variant. Returns ``hits`` (``{name: [TargetHit or None per
    repetition]}``, from ``staleness.first_reach``), ``runs`` (the ``TrainResult`` s, in the
    same order) and ``summary`` (``staleness.race_summary`` against ``baseline``).
    """
    checks.positive_int("repeats", repeats)
    checks.positive_number("target_loss", target_loss)
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of {list(variants)}")
    for name, kwargs in variants.items():
        if "mode" not in kwargs or {"target_loss", "clock"} & set(kwargs):
            raise ValueError(f"variant {name!r}: give train's arguments with a mode, and leave "
                             f"target_loss and clock to race_to_target; got {sorted(kwargs)}")
    for kwargs in variants.values():
        train(**{**kwargs, "steps": 1, "eval_every": 0})
    names = list(variants)
    runs: dict[str, list[TrainResult]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(train(**variants[name], target_loss=target_loss, clock=clock))
    hits = {name: [first_reach(result, target_loss) for result in runs[name]] for name in names}
    return {"hits": hits, "runs": runs, "summary": race_summary(hits, baseline)}
