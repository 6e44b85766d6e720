"""Lock-free asynchronous SGD (Hogwild, Niu et al. 2011) on shared ``tf.Variable`` s, and what the
missing lock lets happen.

``accel.parallel.parameter_server``'s ``async`` mode reads and updates the parameters under the
server's lock, one gradient at a time (asynchronous SGD as in Downpour SGD, Dean et al. 2012).
Here no Python lock is held around the parameters: each worker thread reads the variables,
computes its gradient and applies it itself with ``ResourceApplyGradientDescent`` (one op per
variable), while other workers read and write the same variables.

What TensorFlow still guarantees: each op on one resource variable is atomic. A dense update
takes the variable's exclusive lock whatever ``use_locking`` says (``ApplyGradientDescentOp``,
``tensorflow/core/kernels/training_ops.cc``, passes ``sparse = false`` to
``MaybeLockVariableInputMutexesInOrder``, ``training_op_helpers.h``); ``ReadVariableOp`` takes a
shared lock, and an update copies the buffer first while a read still holds it
(``PrepareToUpdateVariable``). So two updates of one variable never interleave and an additive
SGD update is never lost; what the missing lock allows is a read of the model that mixes
versions across variables (one layer before another worker's update, the next after it). The
element-level race of Hogwild's paper needs sparse updates without ``use_locking``:
``accel.course.sync_async.race_increments`` counts it. A small bookkeeping lock guards only
Python counters and records, never a TensorFlow op.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.parallel.staleness import UpdateRecord

__all__ = ["pad_step", "run_workers", "run_lock_free"]


def pad_step(start: float, step_time: float, factor: float) -> None:
    """Sleep so that the step begun at ``start`` (``time.perf_counter()``) lasts
    ``factor * max(compute time, step_time)``: a device's compute time on shared CPU cores."""
    base = max(time.perf_counter() - start, step_time)
    remaining = start + factor * base - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class _Shared:
    """What the workers share besides the variables: counters, records, the stop event."""

    def __init__(self, steps, clock, eval_fn, eval_every):
        self.book = threading.Lock()  # bookkeeping only: never held while TensorFlow runs
        self.stop = threading.Event()
        self.steps, self.clock, self.eval_fn, self.eval_every = steps, clock, eval_fn, eval_every
        self.tickets = self.finished = self.examples = 0
        self.records, self.update_spans, self.read_spans = [], [], []
        self.curve, self.curve_time, self.error, self.last_update = [], [], None, None
        self.t0 = clock()

    def now(self) -> float:
        return self.clock() - self.t0


def _worker(shared: _Shared, w, variables, update, fn, batches, step_time, factor) -> None:
    i = 0
    try:
        while not shared.stop.is_set():
            r0, read_version = shared.now(), shared.finished
            params = [tf.identity(v) for v in variables]  # no lock: versions may mix
            r1, start = shared.now(), time.perf_counter()
            xb, yb = batches[i % len(batches)]
            loss, grads = fn(params, xb, yb)
            loss = float(loss)
            pad_step(start, step_time, factor)
            with shared.book:
                ticket, applied_version = shared.tickets, shared.finished
                shared.tickets += 1
            if ticket >= shared.steps:
                shared.stop.set()
                return
            a0 = shared.now()
            update(list(zip(grads, variables, strict=True)))  # concurrently with other workers
            a1 = shared.now()
            with shared.book:
                shared.finished += 1
                version, shared.examples = shared.finished, shared.examples + int(xb.shape[0])
                shared.records.append(UpdateRecord(w, read_version, applied_version, loss, a1,
                                                   int(xb.shape[0]), step=i))
                shared.update_spans.append((a0, a1))
                shared.read_spans.append((r0, r1))
                examples = shared.examples
                if version == shared.steps:
                    shared.last_update = a1
            if shared.eval_every and version % shared.eval_every == 0:
                value = float(shared.eval_fn([tf.identity(v) for v in variables]))
                with shared.book:
                    shared.curve.append((examples, value))
                    shared.curve_time.append(a1)
            i += 1
    except BaseException as exc:  # handed to the caller, which re-raises it
        with shared.book:
            shared.error = shared.error or (w, exc)
        shared.stop.set()


def run_workers(target: Callable, args_per_worker: Sequence[tuple], stop: Callable[[], None],
                failed: Callable[[], tuple | None], note: Callable[[int], str]) -> None:
    """One daemon thread ``ps-worker-{w}`` per ``args_per_worker[w]`` running ``target``; waits
    for all. Whatever ends the wait (the workers finishing, an exception, KeyboardInterrupt in
    the caller), ``stop()`` tells the rest to end and they are joined, so no thread outlives the
    call. Then ``failed()`` (``None`` or ``(worker, exception)``) is re-raised with ``note(w)``."""
    threads = [threading.Thread(target=target, name=f"ps-worker-{w}", daemon=True, args=args)
               for w, args in enumerate(args_per_worker)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # short waits: a SIGINT delivered to another thread of the
                t.join(0.05)     # process only reaches Python when the main thread wakes up
    finally:
        stop()
        for t in (t for t in threads if t.is_alive()):
            t.join()
    error = failed()
    if error is not None:
        w, exc = error
        exc.add_note(note(w))
        raise exc


def run_lock_free(variables: Sequence[tf.Variable], update: Callable, grad_fns: Sequence,
                  batches: Sequence, *, steps: int, step_time: float = 0.0,
                  slowdown: dict | None = None, eval_fn: Callable | None = None,
                  eval_every: int = 0, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Run one thread per ``grad_fns[w]`` (``fn(params, x, y) -> (loss, grads)``) on its
    ``batches[w]``, each applying ``update([(grad, var), ...])`` itself, without a lock, until
    ``steps`` updates are applied. Returns ``records``, ``update_spans``, ``read_spans``,
    ``curve``, ``curve_time`` and ``wall_time`` (seconds to the last update). A stop (an
    exception in a worker, or KeyboardInterrupt in the caller) ends and joins every thread."""
    checks.positive_int("steps", steps)
    shared = _Shared(steps, clock, eval_fn, eval_every)
    if eval_every:
        shared.curve.append((0, float(eval_fn([tf.identity(v) for v in variables]))))
        shared.curve_time.append(0.0)
        shared.t0 = clock()
    run_workers(_worker, [(shared, w, variables, update, grad_fns[w], batches[w], step_time,
                           (slowdown or {}).get(w, 1.0)) for w in range(len(grad_fns))],
                stop=shared.stop.set, failed=lambda: shared.error,
                note=lambda w: f"raised by lock-free worker {w}")
    order = np.argsort([s[1] for s in shared.update_spans], kind="stable")
    return {"records": [shared.records[j] for j in order],
            "update_spans": [shared.update_spans[j] for j in order],
            "read_spans": [shared.read_spans[j] for j in order],
            "curve": shared.curve, "curve_time": shared.curve_time,
            "wall_time": shared.last_update if shared.last_update is not None else shared.now()}
