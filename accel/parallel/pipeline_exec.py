"""Running a pipeline schedule on TensorFlow devices: stage ``s`` on ``devices[s]``.

A *stage* is a function ``fn(params, x) -> y`` with its variables, pinned to one device (the
layers of one part of a split, ``accel.parallel.partition``). ``run_schedule`` executes any
schedule in the format of ``accel.parallel.pipeline`` (GPipe, 1F1B or your own), after checking
it with ``validate_schedule``:

* one Python thread per stage runs that stage's tasks in the schedule's order, each task starting
  when the tasks it depends on have finished (the stage threads overlap, as devices do);
* the forward of micro-batch ``i`` on stage ``s`` runs under a ``tf.GradientTape`` that is kept
  (its activations are *stashed*) until the backward of ``i`` on ``s`` consumes it; with
  ``recompute=True`` only the stage's input is kept and the forward is run again during the
  backward (GPipe's rematerialisation);
* the last stage adds the loss: each micro-batch's mean loss weighted by its share of the batch,
  so the sum of the micro-batch gradients is the gradient of the whole batch's mean loss;
* every stage accumulates its parameters' gradients over the micro-batches; ``make_pipeline_step``
  applies one update per batch.

The run returns each device's log ``(task, start, end)`` (from ``clock``), the order in which it
ran its tasks, and the peak number of stashed micro-batches per stage, counted as it runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import tensorflow as tf

from accel import checks
from accel.devices import parse_device
from accel.parallel.pipeline import Task, interval_idle_fractions, stage_orders, validate_schedule
from accel.training import make_update

__all__ = ["Stage", "PipelineRun", "split_microbatches", "run_schedule", "make_pipeline_step",
           "measured_idle_fractions"]


@dataclass
class Stage:
    """One pipeline stage: ``fn(params, x) -> y`` with ``params`` (variables) on ``device``."""

    fn: Callable
    params: list
    device: str


@dataclass
class PipelineRun:
    """What ``run_schedule`` returns: the batch's loss, each stage's accumulated gradients,
    each device's log of ``(task, start, end)``, and the peak stash per stage."""

    loss: float
    grads: list[list[tf.Tensor]]
    log: list[list[tuple[Task, float, float]]] = field(default_factory=list)
    peak_stash: list[int] = field(default_factory=list)

    def orders(self) -> list[list[Task]]:
        """The order in which each stage ran its tasks."""
        return [[task for task, _, _ in entries] for entries in self.log]


def split_microbatches(x, y, num_microbatches: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """``(x, y)`` cut into ``num_microbatches`` equal micro-batches along axis 0
    (``ValueError`` naming the sizes if the batch does not divide)."""
    checks.positive_int("num_microbatches", num_microbatches)
    n = int(x.shape[0])
    if n % num_microbatches or int(y.shape[0]) != n:
        raise ValueError(f"a batch of {n} examples (labels: {int(y.shape[0])}) does not split "
                         f"into {num_microbatches} equal micro-batches")
    size = n // num_microbatches
    return [(x[k * size:(k + 1) * size], y[k * size:(k + 1) * size])
            for k in range(num_microbatches)]


class _Run:
    """Shared state of one run: finished-task events, activations, stashes, logs."""

    def __init__(self, stages, micro, loss_fn, recompute, clock):
        self.stages, self.micro, self.loss_fn = stages, micro, loss_fn
        self.recompute, self.clock = recompute, clock
        self.done: dict[Task, threading.Event] = {}
        self.outputs: dict[tuple[int, int], tf.Tensor] = {}   # (stage, mb) -> forward output
        self.input_grads: dict[tuple[int, int], tf.Tensor] = {}  # (stage, mb) -> d loss / d x
        self.stash: dict[tuple[int, int], tuple] = {}
        self.losses: dict[int, tf.Tensor] = {}
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        p = len(stages)
        self.grads: list[list | None] = [None] * p
        self.log: list[list] = [[] for _ in range(p)]
        self.held, self.peak = [0] * p, [0] * p

    def wait(self, task: Task) -> None:
        stage, mb, phase = task
        deps = [(stage - 1, mb, "F")] if phase == "F" and stage > 0 else []
        if phase == "B":
            deps = [(stage, mb, "F")] + ([(stage + 1, mb, "B")]
                                         if stage < len(self.stages) - 1 else [])
        for dep in deps:
            while not self.done[dep].wait(0.05):
                if self.error is not None:
                    raise RuntimeError("another stage failed")

    def forward(self, s: int, i: int) -> None:
        stage, last = self.stages[s], s == len(self.stages) - 1
        x = self.micro[i][0] if s == 0 else self.outputs.pop((s - 1, i))
        with tf.device(stage.device):
            x = tf.identity(x)
            if self.recompute:  # keep nothing but x: no tape records this forward
                out = self._stage_out(s, i, x)
                self.stash[(s, i)] = (x,)
            else:
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    out = self._stage_out(s, i, x)
                self.stash[(s, i)] = (x, tape, out)
        if last:
            self.losses[i] = out
        else:
            self.outputs[(s, i)] = out
        with self.lock:
            self.held[s] += 1
            self.peak[s] = max(self.peak[s], self.held[s])

    def _stage_out(self, s: int, i: int, x):
        """The stage's output; on the last stage, the micro-batch's loss weighted by its share."""
        stage = self.stages[s]
        out = stage.fn(stage.params, x)
        if s == len(self.stages) - 1:
            share = x.shape[0] / sum(int(m[0].shape[0]) for m in self.micro)
            out = tf.reduce_mean(self.loss_fn(self.micro[i][1], out)) * share
        return out

    def backward(self, s: int, i: int) -> None:
        stage, last = self.stages[s], s == len(self.stages) - 1
        saved = self.stash.pop((s, i))
        with tf.device(stage.device):
            if self.recompute:  # run the forward again, now under a tape
                x = saved[0]
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    out = self._stage_out(s, i, x)
            else:
                x, tape, out = saved
            upstream = None if last else self.input_grads.pop((s + 1, i))
            sources = [*stage.params] if s == 0 else [x, *stage.params]  # stage 0: no dx needed
            grads = tape.gradient(out, sources, output_gradients=upstream)
        if s > 0:
            self.input_grads[(s, i)], grads = grads[0], grads[1:]
        acc = self.grads[s]
        self.grads[s] = list(grads) if acc is None else [a + g for a, g in
                                                         zip(acc, grads, strict=True)]
        with self.lock:
            self.held[s] -= 1

    def stage_loop(self, s: int, order: list[Task]) -> None:
        try:
            for task in order:
                self.wait(task)
                start = self.clock()
                (self.forward if task[2] == "F" else self.backward)(s, task[1])
                self.log[s].append((task, start, self.clock()))
                self.done[task].set()
        except BaseException as exc:  # handed to the caller
            with self.lock:
                if self.error is None:
                    self.error = exc
                    exc.add_note(f"raised by pipeline stage {s} on {self.stages[s].device}")


def run_schedule(stages: Sequence[Stage], schedule, x, y, loss_fn: Callable,
                 num_microbatches: int, recompute: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> PipelineRun:
    """Run one forward and backward pass of the batch ``(x, y)`` through ``stages`` in the
    order of ``schedule``; return the loss, the accumulated gradients and the logs (see the
    module docstring). ``loss_fn(y_true, y_pred)`` returns per-example losses."""
    stages = list(stages)
    if not stages:
        raise ValueError("stages is empty: give one Stage per device")
    for st in stages:
        parse_device(st.device)
    validate_schedule(schedule, len(stages), num_microbatches)
    run = _Run(stages, split_microbatches(x, y, num_microbatches), loss_fn, recompute, clock)
    orders = stage_orders(schedule, len(stages))
    run.done = {task: threading.Event() for order in orders for task in order}
    threads = [threading.Thread(target=run.stage_loop, args=(s, order), daemon=True,
                                name=f"pipeline-stage-{s}") for s, order in enumerate(orders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if run.error is not None:
        raise run.error
    loss = float(tf.add_n([run.losses[i] for i in sorted(run.losses)]))
    return PipelineRun(loss, run.grads, run.log, run.peak)


def make_pipeline_step(stages: Sequence[Stage], loss_fn: Callable, optimizer, schedule,
                       num_microbatches: int, recompute: bool = False):
    """A training step ``step(x, y) -> PipelineRun``: ``run_schedule``, then one update per batch.

    ``optimizer``: a learning rate (plain SGD, each stage's update on its own device) or one
    optimizer object for the whole model (built on all stages' variables; one
    ``apply_gradients`` per step, so its step counter advances once per batch).
    """
    stages = list(stages)
    variables = [v for st in stages for v in st.params]
    one_optimizer = checks.learning_rate(optimizer) is None
    if one_optimizer:
        updates = [make_update(optimizer, variables)]
    else:
        updates = [make_update(optimizer, st.params, st.device) for st in stages]

    def step(x, y) -> PipelineRun:
        result = run_schedule(stages, schedule, x, y, loss_fn, num_microbatches, recompute)
        if one_optimizer:
            grads = [g for stage_grads in result.grads for g in stage_grads]
            updates[0](list(zip(grads, variables, strict=True)))
            return result
        for st, update, grads in zip(stages, updates, result.grads, strict=True):
            with tf.device(st.device):
                update(list(zip(grads, st.params, strict=True)))
        return result

    return step


def measured_idle_fractions(run: PipelineRun) -> list[float]:
    """Each device's idle share of the run's span (first task start to last task end), from
    the busy intervals it logged: the bubble as measured, not as scheduled."""
    return interval_idle_fractions(run.log)
