"""Running a pipeline schedule on TensorFlow devices.

A *stage* is a function ``fn(params, x) -> y`` with its variables, pinned to one device (the
layers of one part of a split, ``accel.parallel.partition``). ``run_schedule`` executes any
schedule in the format of ``accel.parallel.pipeline`` (GPipe, 1F1B, interleaved 1F1B, ZB-H1,
ZB-V or your own), after checking it with ``validate_schedule``. The stages' devices say where
each runs: ``p`` different devices for ``p`` stages, or, for virtual stages, the ``p`` devices
repeated, stage ``s`` on the device of stage ``s % p`` (``[d0, d1, d0, d1]``: interleaved
1F1B's placement, ``"loop"``), or down and back up as a V, stage ``s >= p`` on the device of
stage ``2p - 1 - s`` (``[d0, d1, d1, d0]``: ZB-V's placement, ``"v"``); the schedule is checked
and run with the placement the devices follow (``pipeline.infer_placement``):

* one Python thread per device runs that device's tasks in the schedule's order, each task
  starting when the tasks it depends on have finished (the device threads overlap, as devices
  do);
* the forward of micro-batch ``i`` on stage ``s`` runs under a ``tf.GradientTape`` that is kept
  (its activations are *stashed*) until the backward of ``i`` on ``s`` consumes it; with
  ``recompute=True`` only the stage's input is kept and the forward is run again during the
  backward (GPipe's rematerialisation; a traced stage runs both in one traced call,
  ``Stage.forward_and_gradients``, where no W task needs its tape);
* where the last stage's device runs a micro-batch's backward right after its forward (1F1B),
  or recomputes it anyway, a traced last stage runs both in that one call too, in the B task
  (``deferred_forwards``): the F task only keeps the input, as nothing but the loss flows
  between the two;
* in a schedule with W tasks (ZB-H1, ZB-V) the backward is split in two, as Qi et al. 2023
  (arXiv:2401.10241, section 2) split it: B computes only the gradient with respect to the
  stage's inputs (what the previous stage waits for) and keeps the tape and the output
  gradients it was seeded with; W, later, computes the parameters' gradients from the same
  seeds, and only then is the stash released. TensorFlow has no switch for half a backward,
  and a ``tape.gradient`` call computes an op input's gradient whenever that input is on the
  tape, asked for or not (``ComputeGradient`` in ``tensorflow/c/eager/tape.h``): a tape that
  recorded the weights would compute their gradients in B too. So the forward runs under two
  tapes, one watching only the stage's inputs (B's) and one only its parameters (W's): B then
  runs the chain of input gradients alone, and W the weight gradients plus that chain again,
  down to the stage's first layer (for Dense layers about 1.5 backwards in all, not 1;
  per-layer tapes, each seeded with its layer's output gradient, would avoid the repeat, but
  a stage's ``fn`` does not expose its layers). A traced stage (``Stage.traced``, the Keras
  form) records one function call, whose backward computes every input's gradient at each
  call: there B and W each cost about a whole backward. The split buys the order (B early, W
  in the bubbles), not less arithmetic. On stage 0, whose input needs no gradient, B computes
  nothing and W does the stage's whole backward. With ``recompute=True`` the forward runs
  again in B, under both tapes, and W's is kept until W;
* the last stage adds the loss: each micro-batch's mean loss weighted by its share of the batch,
  so the sum of the micro-batch gradients is the gradient of the whole batch's mean loss;
* every stage accumulates its parameters' gradients over the micro-batches; ``make_pipeline_step``
  applies one update per batch.

The run returns each device's log ``(task, start, end)`` (from ``clock``), the order in which it
ran its tasks, the peak number of stashed micro-batches per stage, counted as it runs, and the
``(stage, micro-batch)`` pairs whose forward ran in their backward task.
``Pipeline`` builds the stages from a Keras ``Sequential``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import tensorflow as tf

from accel import checks
from accel.devices import parse_device
from accel.parallel import graph, partition
from accel.parallel import keras_model as km
from accel.parallel.form import Form, device_list
from accel.parallel.pipeline import (
    SCHEDULE_PLACEMENT,
    Task,
    dependencies,
    device_orders,
    infer_placement,
    interval_idle_fractions,
    make_schedule,
    splits_backward,
    stage_device,
    validate_schedule,
)
from accel.training import make_update

__all__ = ["Stage", "PipelineRun", "split_microbatches", "layer_stages", "stage_devices",
           "stage_placement", "deferred_forwards",
           "run_schedule", "make_pipeline_step", "measured_idle_fractions", "Pipeline"]


@dataclass
class Stage:
    """One pipeline stage: ``fn(params, x) -> y`` with ``params`` (variables) on ``device``.
    ``adds_losses``: ``fn`` returns ``(y, terms)`` instead, ``terms`` the loss terms its layers
    added during the call (``model.losses``: regularizers, ``add_loss``), which the stage adds
    to the training loss with the micro-batch's share."""

    fn: Callable
    params: list
    device: str
    adds_losses: bool = False
    bundles: bool = False  # fn takes and returns tuples of tensors (a graph part's bundles)
    traced: bool = False  # each task one call of a tf.function (fn, its terms and the loss)
    _traced_fns: dict = field(default_factory=dict, repr=False, compare=False)

    def output_fn(self, loss_fn: Callable | None, input_grads: bool = True) -> Callable:
        """``out(x, y, share) -> (output, added)``: ``fn`` on ``x`` and the terms its layers
        added (``None`` if none), both weighted by ``share``; with ``loss_fn`` (the last stage)
        the output is the loss of ``y``, weighted by ``share``, and the terms are in it.
        ``traced``: one ``tf.function`` per ``loss_fn``, so a task dispatches one call
        instead of every op from Python; under a tape, its gradient is one call too. Without
        ``input_grads`` (the first stage) ``x`` enters through ``tf.stop_gradient``: the
        function's traced backward, which serves every float input, skips ``x``'s gradient
        (for a Dense layer, one matmul of the backward's two)."""
        key = (id(loss_fn), input_grads)
        if key not in self._traced_fns:
            def out(x, y, share):
                return self._forward(loss_fn, input_grads, x, y, share)
            fn = tf.function(out, autograph=False) if self.traced else out
            self._traced_fns[key] = (fn, loss_fn)
        return self._traced_fns[key][0]

    def output(self, loss_fn: Callable | None, input_grads: bool, x, y, share):
        """``output_fn(loss_fn, input_grads)(x, y, share)``. A traced stage calls the concrete
        function traced for these shapes and dtypes (``get_concrete_function``, kept per
        shape): the ``tf.function`` call binds its arguments and looks its trace up at every
        call, which cost about 0.2 ms of a 0.46 ms call on the overhead benchmark's stage."""
        fn = self.output_fn(loss_fn, input_grads)
        if not self.traced:
            return fn(x, y, share)
        return self._concrete(("output", id(loss_fn), input_grads), fn, x, y, share)

    def forward_and_gradients(self, loss_fn: Callable | None, input_grads: bool, x, y, share,
                              output_grads, loss_scale, sums=None) -> tuple:
        """``(loss, gradients)``: a traced stage's forward and backward as one call (a
        recomputing backward, or the last stage's deferred forward, ``_Run.deferred``): the
        forward runs under a tape inside a ``tf.function``, which returns the gradients of
        ``x``'s float tensors (with ``input_grads``) and of the parameters, seeded as
        ``_Run.backward`` seeds them (``output_grads``: the next stage's, ``None`` on the last
        stage; ``loss_scale`` or ``None``), and, with ``loss_fn`` (the last stage), the
        micro-batch's weighted loss (else ``None``). ``sums``: the parameters' gradients of the
        earlier micro-batches, added in the same call (their sums returned instead; ``None``
        entries are left out). An eager tape around the forward's call and its ``gradient``
        cost 1.3 ms on the overhead benchmark's 2-layer stage; the one call 0.67."""
        key = ("forward and backward", id(loss_fn), input_grads)
        if key not in self._traced_fns:
            def back(x, y, share, output_grads, loss_scale, sums):
                inputs = km.float_tensors(tf.nest.flatten(x)) if input_grads else []
                with tf.GradientTape() as tape:
                    tape.watch(inputs)
                    out, extra = self._forward(loss_fn, input_grads, x, y, share)
                with tf.device(self.device):
                    targets, seeds = _targets_and_seeds(out, extra, output_grads, loss_scale)
                    grads = _gradient(tape, targets, seeds, [*inputs, *self.params])
                    if sums is not None:
                        grads[len(inputs):] = [km.merge_gradients([a, g]) for a, g in
                                               zip(sums, grads[len(inputs):], strict=True)]
                return (out if loss_fn is not None else None), grads
            self._traced_fns[key] = tf.function(back, autograph=False)
        return self._concrete(key, self._traced_fns[key], x, y, share, output_grads, loss_scale,
                              sums)

    def _forward(self, loss_fn, input_grads: bool, x, y, share):
        if not input_grads:
            x = tf.nest.map_structure(tf.stop_gradient, x)
        with tf.device(self.device):
            return _stage_output(self, loss_fn, x, y, share)

    def _concrete(self, key: tuple, fn, *args):
        """``fn(*args)`` through the concrete function of ``fn`` (a ``tf.function``) traced for
        the arguments' structure and type specs (shapes, dtypes; an ``IndexedSlices``' rows),
        kept under ``key`` and those. Under ``tf.config.run_functions_eagerly(True)`` (for
        debugging) ``fn`` is called as it is, and runs eagerly."""
        if tf.config.functions_run_eagerly():
            return fn(*args)
        key = (*key, _spec_key(args))
        concrete = self._traced_fns.get(key)
        if concrete is None:
            concrete = self._traced_fns[key] = fn.get_concrete_function(*args)
        return concrete(*args)


def _spec_key(a):
    """A hashable key of ``a``'s structure and type specs: tuples and lists by kind and length,
    a tensor by shape and dtype, ``IndexedSlices`` by their values' (row count included);
    anything else by its ``tf.TypeSpec`` (a few microseconds for the rest, 90 for a TypeSpec)."""
    if a is None:
        return None
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, *map(_spec_key, a))
    if isinstance(a, tf.IndexedSlices):
        return ("IndexedSlices", tuple(a.values.shape), a.values.dtype)
    if isinstance(a, (tf.Tensor, tf.Variable)):
        return tuple(a.shape), a.dtype
    return repr(tf.type_spec_from_value(a))


def _stage_output(stage: Stage, loss_fn, x, y, share):
    out, extra = stage.fn(stage.params, x), None
    if stage.adds_losses:
        out, terms = out
        extra = km.added_loss(terms)
        extra = None if extra is None else extra * tf.cast(share, extra.dtype)
    if loss_fn is not None:
        out = km.outputs_loss(loss_fn, y, out if isinstance(out, tuple) else (out,))
        out = out * tf.cast(share, out.dtype)
        if extra is not None:
            out, extra = out + tf.cast(extra, out.dtype), None
    return out, extra


@dataclass
class PipelineRun:
    """What ``run_schedule`` returns: the batch's loss, each stage's accumulated gradients,
    each device's log of ``(task, start, end)``, the peak stash per stage, and the
    ``(stage, micro-batch)`` pairs whose forward ran inside their backward task
    (``deferred_forwards``: in the log, that F only kept its input, that B did both)."""

    loss: float
    grads: list[list[tf.Tensor]]
    log: list[list[tuple[Task, float, float]]] = field(default_factory=list)
    peak_stash: list[int] = field(default_factory=list)
    deferred: set[tuple[int, int]] = field(default_factory=set)

    def orders(self) -> list[list[Task]]:
        """The order in which each device ran its tasks."""
        return [[task for task, _, _ in entries] for entries in self.log]


def split_microbatches(x, y, num_microbatches: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """``(x, y)`` cut into ``num_microbatches`` equal micro-batches along axis 0
    (``ValueError`` naming the sizes if the batch does not divide)."""
    checks.positive_int("num_microbatches", num_microbatches)
    n = int(tf.nest.flatten(x)[0].shape[0])
    labels = {int(t.shape[0]) for t in tf.nest.flatten(y)} | {
        int(t.shape[0]) for t in tf.nest.flatten(x)}
    if n % num_microbatches or labels != {n}:
        raise ValueError(f"a batch of {n} examples (inputs and labels: {sorted(labels)}) does "
                         f"not split into {num_microbatches} equal micro-batches")
    flat = tf.nest.flatten((x, y))
    pieces = [tf.split(t, num_microbatches) for t in flat]  # one op per tensor, not per piece
    return [tf.nest.pack_sequence_as((x, y), [p[k] for p in pieces])
            for k in range(num_microbatches)]


def layer_stages(layers: Sequence, balance: Sequence[int], devices: Sequence[str]) -> list[Stage]:
    """Stages from ``(fn, arrays)`` layers (``accel.parallel.layers``; ``fn(params, x)``): cut by
    ``balance`` (layers per stage, ``accel.parallel.partition``), stage ``s`` on
    ``devices[s]`` with its layers' variables created there. (A Keras ``Sequential``:
    ``Pipeline``.)"""
    layers = list(layers)
    ranges = partition.part_ranges(partition.check_balance(balance, len(layers)))
    if len(ranges) > len(devices):
        raise ValueError(f"{len(ranges)} stages need {len(ranges)} devices, got {len(devices)}: "
                         f"{list(devices)}")
    stages = []
    for r, device in zip(ranges, devices[:len(ranges)], strict=True):
        fns = [layers[i][0] for i in r]
        with tf.device(device):
            variables = [[tf.Variable(a) for a in layers[i][1]] for i in r]
        counts = [len(v) for v in variables]

        def fn(params, x, fns=fns, counts=counts):
            start = 0
            for f, k in zip(fns, counts, strict=True):
                x = f(params[start:start + k], x)
                start += k
            return x

        stages.append(Stage(fn, [v for vs in variables for v in vs], device))
    return stages


class _Run:
    """Shared state of one run: finished-task events, activations, stashes, logs."""

    def __init__(self, stages, micro, loss_fn, recompute, clock, loss_scale=None,
                 split=False):
        self.stages, self.micro, self.loss_fn = stages, micro, loss_fn
        self.split = split  # the schedule has W tasks: B = input gradients, W = weights
        self.loss_scale = loss_scale
        rows = [int(tf.nest.flatten(m[0])[0].shape[0]) for m in micro]
        self.shares = [r / sum(rows) for r in rows]  # each micro-batch's share of the batch
        self._share_tensors: dict[tuple[str, int], tf.Tensor] = {}
        self.recompute, self.clock = recompute, clock
        # (stage, micro-batch) whose forward runs in its backward's one call (deferred_forwards)
        self.deferred: set[tuple[int, int]] = set()
        self.done: dict[Task, threading.Event] = {}
        self.outputs: dict[tuple[int, int], tf.Tensor] = {}   # (stage, mb) -> forward output
        self.input_grads: dict[tuple[int, int], tf.Tensor] = {}  # (stage, mb) -> d loss / d x
        self.stash: dict[tuple[int, int], tuple] = {}
        self.losses: dict[int, tf.Tensor] = {}
        self.added: dict[tuple[int, int], tf.Tensor] = {}  # (stage, mb) -> its added terms
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        p = len(stages)
        self.num_devices = len(stage_devices(stages))
        self.grads: list[list | None] = [None] * p
        self.log: list[list] = [[] for _ in range(self.num_devices)]
        self.held, self.peak = [0] * p, [0] * p

    def wait(self, task: Task) -> None:
        for dep in dependencies(task, len(self.stages)):
            while not self.done[dep].wait(0.05):
                if self.error is not None:
                    raise RuntimeError("another stage failed")

    def forward(self, s: int, i: int) -> None:
        stage, last = self.stages[s], s == len(self.stages) - 1
        x = self.micro[i][0] if s == 0 else self.outputs.pop((s - 1, i))
        if s == 0 and stage.bundles:
            x = km.bundle(x)
        with tf.device(stage.device):
            x = tf.nest.map_structure(tf.identity, x)
            if (s, i) in self.deferred:  # B runs it, in one call with the backward
                out = extra = None
                self.stash[(s, i)] = (x,)
            elif self.recompute:  # keep nothing but x: no tape records this forward
                out, extra = self._stage_out(s, i, x)
                self.stash[(s, i)] = (x,)
            else:
                tape, out, extra = self._taped(s, i, x)
                self.stash[(s, i)] = (x, tape, out, extra)
        if extra is not None:
            self.added[(s, i)] = extra
        if last:
            if out is not None:
                self.losses[i] = out
        else:
            self.outputs[(s, i)] = out
        with self.lock:
            self.held[s] += 1
            self.peak[s] = max(self.peak[s], self.held[s])

    def share(self, s: int, i: int) -> tf.Tensor:
        """Micro-batch ``i``'s share as a scalar on stage ``s``'s device (made once a run)."""
        device = self.stages[s].device
        if (device, i) not in self._share_tensors:
            with tf.device(device):
                self._share_tensors[(device, i)] = tf.constant(self.shares[i], tf.float32)
        return self._share_tensors[(device, i)]

    def _stage_out(self, s: int, i: int, x):
        """``(output, added)`` of stage ``s`` on micro-batch ``i`` (``Stage.output_fn``): on
        the last stage the micro-batch's loss; each weighted by its share of the batch."""
        last = s == len(self.stages) - 1
        return self.stages[s].output(self.loss_fn if last else None, s > 0, x,
                                     self.micro[i][1] if last else None, self.share(s, i))

    def _taped(self, s: int, i: int, x):
        """``(tape, output, added)``: stage ``s``'s forward on micro-batch ``i`` under a tape
        that watches its float inputs (none on stage 0, whose input needs no gradient: maybe
        token ids) and its variables. Where the backward is split, ``tape`` is a pair: one
        tape watching only the inputs (B's), one only the parameters (W's)."""
        inputs = km.float_tensors(tf.nest.flatten(x)) if s > 0 else []
        if not self.split:
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                out, extra = self._stage_out(s, i, x)
            return tape, out, extra
        with tf.GradientTape(watch_accessed_variables=False) as of_inputs, \
                tf.GradientTape(watch_accessed_variables=False) as of_weights:
            of_inputs.watch(inputs)
            # a Keras variable is watched through the tf.Variable it wraps (as its ``handle``)
            of_weights.watch([v if isinstance(v, tf.Variable) else v.value
                              for v in self.stages[s].params])
            out, extra = self._stage_out(s, i, x)
        return (of_inputs, of_weights), out, extra

    def backward(self, s: int, i: int) -> None:
        """B: the gradients of the stage's inputs (sent to stage ``s - 1``) and, unless the
        schedule has W tasks, of its parameters too (accumulated); with W tasks the tape and
        the seeds stay stashed for ``weights``."""
        stage, last = self.stages[s], s == len(self.stages) - 1
        saved = self.stash.pop((s, i))
        # the gradient the next stage sent back for each float tensor passed on (none: the loss)
        output_grads = None if last else self.input_grads.pop((s + 1, i))
        # stage 0 needs no gradient of its input; the others, of each float tensor received
        inputs = [] if s == 0 else km.float_tensors(tf.nest.flatten(saved[0]))
        summed = None
        with tf.device(stage.device):
            if (s, i) in self.deferred or (self.recompute and stage.traced and not self.split):
                # the sums so far join the call, but for sparse ones (their rows grow at each
                # add, which would trace the function again for every micro-batch): None there
                if self.grads[s] is not None:
                    summed = [None if km.is_sparse(a) else a for a in self.grads[s]]
                out, grads = stage.forward_and_gradients(  # one call: forward, backward
                    self.loss_fn if last else None, s > 0, saved[0],
                    self.micro[i][1] if last else None, self.share(s, i), output_grads,
                    self.loss_scale, summed)
                if last:
                    self.losses[i] = out
            else:
                if self.recompute:  # run the forward again, now under a tape
                    tape, out, extra = self._taped(s, i, saved[0])
                else:
                    _, tape, out, extra = saved
                sources = inputs if self.split else [*inputs, *stage.params]
                targets, seeds = _targets_and_seeds(out, extra, output_grads, self.loss_scale)
                if self.split:
                    tape, of_weights = tape
                grads = _gradient(tape, targets, seeds, sources) if sources else []
        if s > 0:
            self.input_grads[(s, i)], grads = list(grads[:len(inputs)]), grads[len(inputs):]
        if self.split:
            self.stash[(s, i)] = (of_weights, targets, seeds)
        else:
            self._accumulate(s, grads, summed)

    def weights(self, s: int, i: int) -> None:
        """W: the parameters' gradients of stage ``s`` on micro-batch ``i``, from the weights'
        tape and the output gradients its B kept; the stash is released here."""
        tape, targets, seeds = self.stash.pop((s, i))
        with tf.device(self.stages[s].device):
            grads = _gradient(tape, targets, seeds, self.stages[s].params)
        del tape
        self._accumulate(s, grads)

    def _accumulate(self, s: int, grads, summed: list | None = None) -> None:
        """Add a micro-batch's parameter gradients to stage ``s``'s sum (``summed``: the sums
        that ``grads`` holds already, ``None`` where it holds the micro-batch's own); one
        stash fewer."""
        acc = self.grads[s]
        summed = [None] * len(grads) if summed is None else summed
        # an embedding's IndexedSlices accumulate as slices (every micro-batch's rows)
        self.grads[s] = list(grads) if acc is None else [
            g if done is not None else km.merge_gradients([a, g])
            for a, g, done in zip(acc, grads, summed, strict=True)]
        with self.lock:
            self.held[s] -= 1

    def device_loop(self, d: int, order: list[Task]) -> None:
        task = None
        try:
            for task in order:
                self.wait(task)
                start = self.clock()
                {"F": self.forward, "B": self.backward, "W": self.weights}[task[2]](
                    task[0], task[1])
                self.log[d].append((task, start, self.clock()))
                self.done[task].set()
        except BaseException as exc:  # handed to the caller
            with self.lock:
                if self.error is None:
                    self.error = exc
                    where = "" if task is None else f"stage {task[0]} "
                    exc.add_note(f"raised by pipeline {where}on {self.stages[d].device}")


def _targets_and_seeds(out, extra, output_grads, loss_scale) -> tuple[list, list]:
    """What a stage's backward differentiates and the gradients it seeds them with: on the last
    stage (``output_grads`` ``None``) the loss, seeded with the loss scale (``None``: 1, the
    loss's own gradient); elsewhere each float tensor the stage passed on, with the gradient the
    next stage sent back; the stage's own loss terms ``extra`` join, seeded with the scale."""
    seed = None
    if loss_scale is not None and (output_grads is None or extra is not None):
        seed = tf.cast(loss_scale, (out if output_grads is None else extra).dtype)
    if output_grads is None:
        targets, seeds = [out], [seed]
    else:
        targets, seeds = km.float_tensors(tf.nest.flatten(out)), list(output_grads)
    if extra is not None:
        targets, seeds = targets + [extra], seeds + [tf.ones_like(extra) if seed is None
                                                     else seed]
    return targets, seeds


def _gradient(tape, targets, seeds, sources) -> list:
    """``d targets / d sources``, ``targets`` seeded with ``seeds`` (``[None]``: the loss's own
    gradient, 1); sources that ``targets`` do not reach get zeros."""
    return tape.gradient(targets, sources, output_gradients=None if seeds == [None] else seeds,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)


def stage_devices(stages: Sequence[Stage]) -> list[str]:
    """The distinct devices of ``stages``, first seen first (``ValueError`` unless one device
    per stage, or virtual stages placed round-robin as interleaved 1F1B wants, stage ``s`` on
    the device of stage ``s % p``, or as a V as ZB-V wants, ``2p`` stages, stage ``s >= p`` on
    the device of stage ``2p - 1 - s``; ``p`` the number of distinct devices)."""
    return stage_placement(stages)[0]


def stage_placement(stages: Sequence[Stage]) -> tuple[list[str], str]:
    """``stage_devices(stages)`` and the placement they follow, ``"loop"`` or ``"v"``
    (``accel.parallel.pipeline.infer_placement`` on the stages' device names)."""
    return infer_placement([parse_device(st.device).to_string() for st in stages])


def deferred_forwards(stages: Sequence[Stage], orders: Sequence[Sequence[Task]],
                      recompute: bool = False) -> set[tuple[int, int]]:
    """The ``(stage, micro-batch)`` pairs whose forward runs inside their backward task, in
    one traced call with it (``Stage.forward_and_gradients``): the last stage's, if traced, in
    a schedule without W tasks, where its device runs the backward right after the forward
    (1F1B: only the loss flows between the two, so nothing else waits for the forward) or
    where the backward recomputes the forward anyway (``recompute``). The F task then only
    keeps the input; B does the forward, the loss and the backward, as ``fit``'s step does,
    without an eager tape, and the micro-batch's loss comes from it."""
    last = len(stages) - 1
    if not stages[last].traced or splits_backward(orders):
        return set()
    deferred = set()
    for order in orders:
        for task, after in zip(order, [*order[1:], None], strict=True):
            if task[0] == last and task[2] == "F" and (
                    recompute or after == (last, task[1], "B")):
                deferred.add((last, task[1]))
    return deferred


def run_schedule(stages: Sequence[Stage], schedule, x, y, loss_fn: Callable,
                 num_microbatches: int, recompute: bool = False,
                 clock: Callable[[], float] = time.perf_counter,
                 loss_scale=None) -> PipelineRun:
    """Run one forward and backward pass of the batch ``(x, y)`` through ``stages`` in the
    order of ``schedule``; return the loss, the accumulated gradients and the logs (see the
    module docstring; a schedule with W tasks splits each backward into B and W there).
    ``loss_fn(y_true, y_pred)`` returns per-example losses. ``loss_scale``:
    a factor the gradients are multiplied by (a ``LossScaleOptimizer``'s scale,
    ``keras_model.loss_scale``); the loss returned is not scaled."""
    stages = list(stages)
    if not stages:
        raise ValueError("stages is empty: give one Stage per device")
    devices, placement = stage_placement(stages)
    num_devices = len(devices)
    validate_schedule(schedule, len(stages), num_microbatches, num_devices, placement)
    run = _Run(stages, split_microbatches(x, y, num_microbatches), loss_fn, recompute, clock,
               loss_scale, split=splits_backward(schedule))
    orders = device_orders(schedule, num_devices, placement)
    run.done = {task: threading.Event() for order in orders for task in order}
    run.deferred = deferred_forwards(stages, orders, recompute)
    threads = [threading.Thread(target=run.device_loop, args=(d, order), daemon=True,
                                name=f"pipeline-device-{d}") for d, order in enumerate(orders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if run.error is not None:
        raise run.error
    parts = [run.losses[i] for i in sorted(run.losses)]
    parts += [tf.cast(run.added[k], parts[0].dtype) for k in sorted(run.added)]
    loss = float(tf.add_n(parts))
    return PipelineRun(loss, run.grads, run.log, run.peak, run.deferred)


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
        scale = km.loss_scale(optimizer) if one_optimizer else None
        result = run_schedule(stages, schedule, x, y, loss_fn, num_microbatches, recompute,
                              loss_scale=scale)
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


class Pipeline(Form):
    """A Keras ``Sequential`` trained as a pipeline: GPipe, 1F1B, interleaved 1F1B, ZB-H1 or ZB-V.

    ``Pipeline(model, devices, loss=..., optimizer=..., num_microbatches=m)`` cuts the model's
    layers into ``p * v`` consecutive stages (``p = len(devices)``, ``v = num_chunks``: left
    out, 2 for ``"zb-v"``, else 1; stage ``s`` on ``devices[s % p]``, or for ``"zb-v"`` on the
    device of ``pipeline.v_shape_device(s, p)``: ``placement`` says which), by ``balance``:
    ``"count"`` (equal layer counts), ``"bytes"`` (parameter bytes), or a list of layer counts
    per stage (kakaobrain/torchgpipe's word).
    Each stage trains a working copy of its layers made on its device
    (``accel.parallel.keras_model``); one Keras optimizer, copied from ``optimizer``'s config,
    updates all stages once per batch, its slots next to their variables.

    * ``run_step(x, y) -> PipelineRun``: one batch, split into ``m`` micro-batches, run in the
      order of ``schedule`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``,
      ``"zb-v"``: see ``accel.parallel.pipeline``; ZB-H1 and ZB-V split each backward into B
      and W, as ``run_schedule`` says), then one update; the run (loss, gradients, each device's
      log of tasks) is also kept as ``last_run``. The user's model is not touched.
    * ``train_step``, ``fit`` (Keras's habits; batches a multiple of ``num_microbatches``) and
      ``write_back``: ``accel.parallel.form.Form``'s.

    Not under ``model.fit``: the stages run in one Python thread per device, so that devices
    overlap as the schedule says; each task is one call of the concrete function traced for
    its stage's layers, recorded by an eager ``GradientTape`` whose gradient is one call of
    the function's traced backward; on the last stage, where the schedule runs a backward right
    after its forward (1F1B), the B task runs the forward, the loss and the backward in one
    traced call, as ``fit``'s step does (``deferred_forwards``); with ``recompute=True`` (and
    no W tasks) every backward task is one traced call that runs the forward again and
    differentiates it, on a traced last stage the forward's only run (``python -m accel bench
    pipeline-overhead`` measures what a task costs beyond its compute). Keras's ``fit``
    compiles one function per step. ``recompute=True`` keeps only each stage's input and
    runs its forward again in the backward (refused for
    layers with non-trainable state: BatchNormalization, whose moving statistics would be
    updated twice, or Dropout, whose second forward would draw another mask).

    BatchNormalization under micro-batches normalises each micro-batch by its own statistics
    and updates the moving statistics once per micro-batch: the result equals one device
    training on batches of the micro-batch size, not on the whole batch.
    """

    name = "pipeline"
    options = ("num_microbatches", "schedule", "num_chunks", "balance", "recompute",
               "split_points")

    def __init__(self, model, devices: Sequence[str], *, loss, optimizer,
                 num_microbatches: int, schedule: str = "1f1b", num_chunks: int | None = None,
                 balance="count", recompute: bool = False,
                 split_points: Sequence[str] | None = None):
        self.model = model
        self.graph = graph.model_graph(model)
        self.layers = [c.layer for c in self.graph.calls]
        self.devices = device_list(devices)  # num_chunks puts several stages on one device
        self.num_microbatches = checks.positive_int("num_microbatches", num_microbatches)
        p = len(self.devices)
        self.schedule = make_schedule(schedule, self.num_microbatches, p, num_chunks)
        self.num_chunks = 2 if schedule == "zb-v" else checks.positive_int(
            "num_chunks", 1 if num_chunks is None else num_chunks)
        self.schedule_name = schedule
        self.placement = SCHEDULE_PLACEMENT[schedule]  # where stage s runs: stage_device
        self.balance = graph.split_sizes(self.graph, p * self.num_chunks, split_points, balance)
        self.graph_parts = graph.cut(self.graph, self.balance)
        # non_trainable_variables: weights such as BatchNormalization's moving statistics, and
        # the seed state of layers that draw random numbers (Dropout, GaussianNoise...)
        stateful = [layer.name for layer in self.layers if layer.non_trainable_variables]
        if recompute and stateful:
            raise ValueError(f"recompute=True with layers that hold non-trainable state "
                             f"({stateful}: moving statistics or a random seed): the forward "
                             "run again would update the statistics twice or draw other random "
                             "numbers than the forward whose loss is reported; leave recompute "
                             "off for this model")
        self.recompute = recompute
        self.loss_fn = km.loss_function(loss)
        self.optimizer = self.make_optimizer(optimizer)
        self.last_run: PipelineRun | None = None
        stage_devices_ = [self.devices[stage_device(s, p * self.num_chunks, p, self.placement)]
                          for s in range(p * self.num_chunks)]
        self.parts = [gp.layers for gp in self.graph_parts]
        self.copies = [graph.copy_part(self.graph, gp, device)
                       for gp, device in zip(self.graph_parts, stage_devices_, strict=True)]
        self.stages = [Stage(_graph_stage_fn(gp, copies),
                             [w for c in copies for w in c.trainable_weights], device,
                             adds_losses=True, bundles=True, traced=True)
                       for gp, copies, device in zip(self.graph_parts, self.copies,
                                                     stage_devices_, strict=True)]
        self._pipeline_step = make_pipeline_step(self.stages, self.loss_fn, self.optimizer,
                                                 self.schedule, self.num_microbatches, recompute)

    def run_step(self, x, y) -> PipelineRun:
        """One batch through the pipeline and one update (the user's model is not touched);
        the run, also kept as ``last_run``."""
        self.last_run = self._pipeline_step(*tf.nest.map_structure(tf.convert_to_tensor, (x, y)))
        return self.last_run

    def _step(self, x, y):
        return self.run_step(x, y).loss

    def batch_parts(self) -> int:
        return self.num_microbatches

    def write_back(self) -> None:
        for part, copies in zip(self.parts, self.copies, strict=True):
            km.write_back(part, copies)

    def working_variables(self) -> list:
        return [w for copies in self.copies for c in copies for w in c.weights]

    def optimizer_variables(self) -> list:
        return list(self.optimizer.variables)

    def crossings(self) -> list[list[tuple]]:
        """What crosses each cut between stages, per example (``accel.parallel.graph``)."""
        return graph.crossings(self.graph, self.graph_parts)


def _graph_stage_fn(part, copies: list) -> Callable:
    def fn(params, bundle):  # params are the copies' own variables, which the tape watches
        # (the bundle passed on, the terms the layers add to the loss)
        return graph.run_part(part, copies, bundle)
    return fn
