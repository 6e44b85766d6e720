"""What ran when in one step: a ``tf.profiler.experimental`` trace read back op by op (and drawn
per device with a placement table), summarised as a table, and the timeline of a traced TF1
session run.

- ``traced_run(session, fetches, feed_dict)``: run once with ``RunOptions(trace_level=FULL_TRACE,
  output_partition_graphs=True)`` and return ``(result, RunMetadata)``.
- ``step_intervals(run_metadata)``: the per-device ``step_stats`` as ``Interval`` rows (device,
  start and end in ms from the step's first op, node name, op type), ready for
  ``accel.viz.timeline``.
- ``profile_trace(fn, logdir)``: call ``fn()`` between ``tf.profiler.experimental.start`` and
  ``stop`` and return the ``*.xplane.pb`` file TensorFlow wrote (open the logdir with
  ``tensorboard --logdir`` and the profile plugin: ``pip install -e ".[profile]"``).
- ``read_trace(fn, read, logdir=None)``: ``read(path)`` of that file; without ``logdir`` the
  trace goes to a temporary folder, removed once read (a trace is several MB).
- ``trace_events(path)`` / ``summarize_trace(events)``: read that file's events back and
  total them per op name, as a table.
- ``op_runs(path)``: the TensorFlow ops of that file (op name, type, start and end on one
  clock for every thread): what ran when, in the order it ran.
- ``device_timeline(runs, table)``: those ops on the lanes of the devices they ran on (a
  ``placement_of`` table of the same function), with one ``'copy -> DEVICE'`` interval per
  tensor sent between devices: the TF2 timeline of one step.
- ``memory_timeline(path)``: the allocator's own record in that file, one ``MemoryEvent`` per
  allocation or free (bytes in use after it, the op that asked): memory over one step.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import tensorflow as tf

from accel import checks
from accel.placement import Placement, short_device

__all__ = ["Interval", "traced_run", "step_intervals", "copy_intervals", "profile_trace",
           "read_trace",
           "TraceEvent", "trace_events", "OpRun", "op_runs", "device_timeline", "summarize_trace",
           "format_summary", "MemoryEvent", "memory_timeline",
           "log_severity", "visible_at_level"]


@dataclass(frozen=True)
class Interval:
    """One op execution: its device, start and end (ms from the step's first op), name, type."""

    lane: str
    start: float
    end: float
    name: str
    op_type: str


def traced_run(session, fetches, feed_dict=None):
    """Run ``fetches`` once in ``session`` with a full trace; return ``(result, RunMetadata)``."""
    opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                   output_partition_graphs=True)
    meta = tf.compat.v1.RunMetadata()
    result = session.run(fetches, feed_dict=feed_dict, options=opts, run_metadata=meta)
    return result, meta


_LABEL_TYPE = re.compile(r"=\s*(\w+)\(")


def step_intervals(run_metadata, skip: Sequence[str] = ("_Arg", "_Retval", "NoOp")
                   ) -> list[Interval]:
    """The ``step_stats`` of ``run_metadata`` as intervals, sorted by start.

    Times are the executor's ``all_start`` / ``all_end`` per node (scheduling included), in ms
    from the earliest start. Op types come from the run's partition graphs when it has them
    (``traced_run`` asks for them), else from the node's timeline label. Ops of a type in
    ``skip`` are left out.
    """
    types = {(short_device(n.device), n.name): n.op
             for g in run_metadata.partition_graphs for n in g.node}
    raw = []
    for dev in run_metadata.step_stats.dev_stats:
        lane = short_device(dev.device)
        for ns in dev.node_stats:
            start = ns.all_start_nanos / 1e6 if ns.all_start_nanos else ns.all_start_micros / 1e3
            length = (ns.all_end_rel_nanos / 1e6 if ns.all_end_rel_nanos
                      else ns.all_end_rel_micros / 1e3)
            label = _LABEL_TYPE.search(ns.timeline_label)
            op_type = types.get((lane, ns.node_name), label[1] if label else "")
            if op_type not in skip:
                raw.append((lane, start, start + length, ns.node_name, op_type))
    if not raw:
        raise ValueError("run_metadata has no step stats: run with trace_level=FULL_TRACE "
                         "(accel.profile.traced_run does)")
    t0 = min(r[1] for r in raw)
    return sorted((Interval(lane, s - t0, e - t0, name, op) for lane, s, e, name, op in raw),
                  key=lambda i: (i.start, i.lane, i.name))


def copy_intervals(run_metadata, intervals: Sequence[Interval]) -> list[Interval]:
    """One interval per cross-device copy, on a lane named ``'copy -> DEVICE'``: from the end of
    the op that produced the tensor to the start of the first op that used it on the other side.

    TensorFlow 2.21 records no step stats for the ``_Send``/``_Recv`` nodes themselves, so the
    copies are found in the partition graphs and timed by their neighbours: the interval is the
    transfer plus the wait of the consumer (the synchronisation point)."""
    done = {(i.lane, i.name): i.end for i in intervals}
    starts = {(i.lane, i.name): i.start for i in intervals}
    nodes = [(short_device(n.device), n) for g in run_metadata.partition_graphs for n in g.node]
    producer = {}  # tensor name of a _Send -> (producing op's end, from, to)
    for dev, n in nodes:
        if n.op == "_Send" and n.input:
            src = n.input[0].split(":")[0].lstrip("^")
            if (dev, src) in done:
                producer[n.attr["tensor_name"].s.decode()] = (
                    done[(dev, src)], src, dev, short_device(n.attr["recv_device"].s.decode()))
    recv_name = {n.attr["tensor_name"].s.decode(): (dev, n.name) for dev, n in nodes
                 if n.op == "_Recv"}
    copies = []
    for tensor, (end, src, _frm, to) in producer.items():
        dev, rname = recv_name.get(tensor, (to, None))
        users = [starts[(dev, n.name)] for d, n in nodes if d == dev and (dev, n.name) in starts
                 and any(i.split(":")[0] == rname for i in n.input)]
        if users:
            copies.append(Interval(f"copy -> {to}", end, max(end, min(users)), f"{src}",
                                   "_Send/_Recv"))
    return sorted(copies, key=lambda i: (i.start, i.lane))


def profile_trace(fn: Callable[[], object], logdir: str) -> str:
    """Call ``fn()`` under ``tf.profiler.experimental`` writing into ``logdir``; return the path
    of the ``*.xplane.pb`` trace it wrote (the newest, if the logdir holds several)."""
    if not callable(fn):
        raise ValueError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")
    tf.profiler.experimental.start(logdir)
    try:
        fn()
    finally:
        tf.profiler.experimental.stop()
    found = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    if not found:
        raise ValueError(f"no *.xplane.pb under {logdir!r}/plugins/profile after the trace")
    return max(found, key=os.path.getmtime)


def read_trace(fn: Callable[[], object], read: Callable[[str], object],
               logdir: str | None = None):
    """``read(path)`` of the trace of ``fn()`` (``profile_trace``), e.g. ``read=op_runs``: the
    trace is written under ``logdir`` and kept there (for TensorBoard), or, without one, into
    a temporary folder that is removed once ``read`` has returned."""
    if logdir is not None:
        return read(profile_trace(fn, logdir))
    with tempfile.TemporaryDirectory(prefix="accel-trace-") as tmp:
        return read(profile_trace(fn, tmp))


@dataclass(frozen=True)
class TraceEvent:
    """One event of a profiler trace: plane (e.g. '/host:CPU'), line (thread), name, times (ms)."""

    plane: str
    line: str
    name: str
    start: float
    duration: float


def trace_events(path: str) -> list[TraceEvent]:
    """Every event of an ``*.xplane.pb`` file, start times in ms from the line's own start."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        meta = {k: (v.display_name or v.name) for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                events.append(TraceEvent(plane.name, line.display_name or line.name,
                                         meta.get(ev.metadata_id, "?"), ev.offset_ps / 1e9,
                                         ev.duration_ps / 1e9))
    return events


@dataclass(frozen=True)
class OpRun:
    """One op execution of a profiler trace: op name (with its scopes), op type, start and end
    in ms from the trace's first op (the same clock for every thread), and the thread that ran
    it."""

    name: str
    type: str
    start: float
    end: float
    thread: str = ""


def _planes(path: str, plane: str) -> list:
    """The planes named ``plane`` of the ``*.xplane.pb`` trace at ``path``."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return [pl for pl in space.planes if pl.name == plane]


def op_runs(path: str, plane: str = "/host:CPU") -> list[OpRun]:
    """The op executions of an ``*.xplane.pb`` trace on ``plane`` (the TensorFlow executor's
    events are named ``"<op name>:<op type>"``), earliest first: a line's events are offsets
    from its own start, so each is placed on the trace's one clock by the line's timestamp."""
    runs = []
    for pl in _planes(path, plane):
        for line in pl.lines:
            for ev in line.events:
                name = pl.event_metadata[ev.metadata_id].name
                if ":" not in name:
                    continue
                op, kind = name.rsplit(":", 1)
                start = line.timestamp_ns * 1e-6 + ev.offset_ps * 1e-9
                runs.append((op, kind, start, start + ev.duration_ps * 1e-9,
                             line.display_name or line.name))
    if not runs:
        return []
    first = min(r[2] for r in runs)
    return sorted((OpRun(op, kind, s - first, e - first, thread)
                   for op, kind, s, e, thread in runs), key=lambda r: r.start)


def device_timeline(runs: Sequence[OpRun], table: Placement,
                    skip: Sequence[str] = ("_Arg", "_Retval", "NoOp")
                    ) -> tuple[list[Interval], list[Interval]]:
    """The ops of a profiler trace on the lanes of the devices they ran on: ``(ops, copies)``.

    ``runs`` are ``op_runs`` of a trace of *one* call of a ``tf.function``; ``table`` is
    ``accel.placement.placement_of`` of the same function (the trace names ops but not their
    devices; the table's partition graphs give each op's device and every ``_Send``/``_Recv``
    pair). Ops are matched by name, types in ``skip`` are left out, and times are in ms from the
    first matched op.

    ``copies`` has one interval per tensor sent between devices, on a lane named
    ``'copy -> DEVICE'``: from the start of its ``_Send`` (the profiler records sends; where the
    trace has none, from the end of the op that made the tensor) to the start of the first op
    that used it on the receiving device. That span is the send, the hand-over and the
    consumer's wait to be scheduled, not a measured transfer: ``_Recv`` leaves no event.
    """
    if not isinstance(table, Placement):
        raise ValueError(f"table must be an accel.placement.Placement (placement_of's result), "
                         f"got {type(table).__name__}")
    device = {r.name: r.device for r in table.rows}
    kind = {r.name: r.op_type for r in table.rows}
    hits = [r for r in runs if r.name in device and kind[r.name] not in skip]
    if not hits:
        raise ValueError("no op of the trace is in the table: trace one call of the function "
                         "whose placement_of table you pass")
    t0 = min(r.start for r in hits)
    ops = sorted((Interval(device[r.name], r.start - t0, r.end - t0, r.name, kind[r.name])
                  for r in hits), key=lambda i: (i.start, i.lane, i.name))
    start, end = {}, {}
    for i in ops:  # the first run of each op
        start.setdefault(i.name, i.start)
        end.setdefault(i.name, i.end)
    nodes = [(short_device(n.device), n) for g in table.graphs for n in g.node]
    recv = {n.attr["tensor_name"].s.decode(): (dev, n.name) for dev, n in nodes
            if n.op == "_Recv"}
    copies = []
    for _dev, n in nodes:
        if n.op != "_Send" or not n.input:
            continue
        src = n.input[0].split(":")[0].lstrip("^")
        begin = start.get(n.name, end.get(src))
        to, rname = recv.get(n.attr["tensor_name"].s.decode(), (None, None))
        users = [start[m.name] for d, m in nodes if d == to and m.name in start
                 and any(i.split(":")[0].lstrip("^") == rname for i in m.input)]
        if begin is not None and users:
            copies.append(Interval(f"copy -> {to}", begin, max(begin, min(users)), src,
                                   "_Send/_Recv"))
    return ops, sorted(copies, key=lambda i: (i.start, i.lane))


@dataclass(frozen=True)
class MemoryEvent:
    """One allocation (``change > 0``) or free (``change < 0``) of a profiler trace: time in ms
    from the trace's first memory event, ``in_use`` the allocator's bytes in use after it,
    ``change`` the bytes it took or gave back (the allocator's chunk: ``in_use`` moves by that),
    ``requested`` the tensor's own bytes (a chunk may be larger), ``op`` the op that asked (""
    for a free), and ``allocator`` the allocator's name."""

    time: float
    in_use: int
    change: int
    requested: int
    op: str
    allocator: str


_MEMORY_EVENTS = {"MemoryAllocation": 1, "MemoryDeallocation": -1}


def memory_timeline(path: str, plane: str = "/host:CPU") -> list[MemoryEvent]:
    """The allocations and frees of an ``*.xplane.pb`` trace on ``plane``, earliest first.

    TensorFlow's BFC allocator records each one while the profiler runs (``MemoryAllocation`` /
    ``MemoryDeallocation`` events with the stats ``bytes_allocated``, its bytes in use after
    the event, ``allocation_bytes``, the chunk it handed out or took back, ``requested_bytes``
    and ``tf_op``): what
    TensorBoard's memory profile tool draws. On a CPU only the BFC allocator records them
    (``TF_CPU_ALLOCATOR_USE_BFC=true``); an empty list means no allocator reported."""
    raw = []
    for pl in _planes(path, plane):
        names = {k: v.name for k, v in pl.stat_metadata.items()}
        for line in pl.lines:
            for ev in line.events:
                sign = _MEMORY_EVENTS.get(pl.event_metadata[ev.metadata_id].name)
                if sign is None:
                    continue
                stats = {}
                for st in ev.stats:
                    kind = st.WhichOneof("value")
                    value = getattr(st, kind) if kind else None
                    stats[names.get(st.metadata_id)] = (names.get(value, "")
                                                        if kind == "ref_value" else value)
                start = line.timestamp_ns * 1e-6 + ev.offset_ps * 1e-9
                raw.append((start, int(stats.get("bytes_allocated", 0)),
                            sign * int(stats.get("allocation_bytes", 0)),
                            sign * int(stats.get("requested_bytes", 0)),
                            str(stats.get("tf_op", "")) if sign > 0 else "",
                            str(stats.get("allocator_name", ""))))
    if not raw:
        return []
    raw.sort(key=lambda r: r[0])
    first = raw[0][0]
    return [MemoryEvent(t - first, *rest) for t, *rest in raw]


def summarize_trace(events: Iterable[TraceEvent], names: Sequence[str] | None = None,
                    plane: str = "/host:CPU", top: int = 10) -> list[tuple[str, int, float]]:
    """``(name, count, total ms)`` per event name on ``plane``, largest total first.

    With ``names``, only those (e.g. the op names of the step); else the ``top`` largest."""
    checks.positive_int("top", top)
    totals: dict[str, list] = {}
    for ev in events:
        if ev.plane == plane and (names is None or ev.name in names):
            row = totals.setdefault(ev.name, [0, 0.0])
            row[0] += 1
            row[1] += ev.duration
    rows = sorted(((k, n, t) for k, (n, t) in totals.items()), key=lambda r: (-r[2], r[0]))
    return rows if names is not None else rows[:top]


_SEVERITY = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "FATAL"}
_LOG_PREFIX = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ \S+:\d+\] ")


def log_severity(line: str) -> str | None:
    """The severity of one line of TensorFlow's C++ log ('INFO', 'WARNING', 'ERROR', 'FATAL'),
    or ``None`` for a line that did not come through the log (e.g. a ``printf``)."""
    m = _LOG_PREFIX.match(line)
    return _SEVERITY[m[1]] if m else None


def visible_at_level(lines: Iterable[str], level: int) -> list[str]:
    """The lines that ``TF_CPP_MIN_LOG_LEVEL=level`` lets through: level 0 all, 1 hides INFO,
    2 also WARNING, 3 also ERROR; lines that are not log lines are never hidden."""
    if level not in (0, 1, 2, 3):
        raise ValueError(f"level must be one of 0, 1, 2, 3 (TF_CPP_MIN_LOG_LEVEL), got {level!r}")
    hidden = ("INFO", "WARNING", "ERROR")[:level]
    return [ln for ln in lines if log_severity(ln) not in hidden]


def format_summary(rows: Sequence[tuple[str, int, float]]) -> str:
    """The summary as aligned text: name, count, total ms."""
    width = max([4, *(len(r[0]) for r in rows)])
    return "\n".join([f"{'name':{width}}  count  total ms"]
                     + [f"{n:{width}}  {c:5d}  {t:8.3f}" for n, c, t in rows])
