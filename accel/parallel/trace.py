"""What a multi-device step did, read from what TensorFlow executed: the tensors that crossed
between devices (with their bytes) and when each device was busy.

* ``transfers_of(fn, *args)`` / ``transfers_of(fetches, session=sess)``: run once and list every
  tensor sent from one device to another (the partition graphs' ``_Send`` nodes), with its
  shape, dtype and bytes; ``Transfer.direction`` says "forward" or "backward" (a tensor made by a
  gradient op: ``gradient_tape/...`` in TF2, ``gradients/...`` in TF1, or under a ``backward``
  name scope). Sends that only carry a
  control edge are listed with ``control=True`` and 0 bytes.
* ``crossing_bytes(transfers)``: bytes per direction; ``format_transfers``: a printable table.
* ``traced_run(session, fetches)``: a TF1 ``session.run`` with ``FULL_TRACE``; its
  ``step_stats`` hold every op's start and end on every device. ``busy_intervals`` merges them
  into busy time per device and ``idle_fractions`` says which share of the step each device
  waited. (``tf.timestamp()`` inside a ``tf.function`` would serialise the step it measures.)

Between logical devices of one process a "transfer" shares the buffer instead of copying it, so
the bytes here are logical: what a real link between two GPUs would have to carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.python.eager import context

from accel.placement import short_device

__all__ = ["Transfer", "transfers_of", "crossing_bytes", "format_transfers", "traced_run",
           "busy_intervals", "idle_fractions"]

BACKWARD_MARKS = ("gradient", "backward")


@dataclass(frozen=True)
class Transfer:
    """One tensor sent between devices in one run."""

    tensor: str  # the producing op's output, e.g. 'part_0/Relu:0'
    source: str
    target: str
    shape: tuple[int, ...] | None  # None where the static shape is not fully known
    dtype: str
    nbytes: int
    control: bool = False

    @property
    def direction(self) -> str:
        """'backward' for a tensor made by a gradient op (its name holds ``gradient`` or
        ``backward``), else 'forward'."""
        return "backward" if any(w in self.tensor for w in BACKWARD_MARKS) else "forward"


def _tensor(graph: tf.Graph, name: str):
    op_name, _, slot = name.partition(":")
    try:
        return graph.get_operation_by_name(op_name).outputs[int(slot or 0)]
    except (KeyError, IndexError, ValueError):
        return None


def _collect(graph_defs, graph: tf.Graph) -> list[Transfer]:
    out = []
    for gd in graph_defs:
        for node in gd.node:
            if node.op != "_Send":
                continue
            source = short_device(node.attr["send_device"].s.decode())
            target = short_device(node.attr["recv_device"].s.decode())
            name = node.input[0] if node.input else node.attr["tensor_name"].s.decode()
            if "/ctrl/" in name or name.startswith("^"):
                out.append(Transfer(name.split("/ctrl/")[0].lstrip("^"), source, target, (),
                                    "control", 0, control=True))
                continue
            t = _tensor(graph, name)
            dtype = tf.as_dtype(node.attr["T"].type)
            shape = tuple(t.shape.as_list()) if t is not None and t.shape.is_fully_defined() \
                else None
            size = dtype.size
            for dim in shape or ():
                size *= dim
            out.append(Transfer(name if ":" in name else name + ":0", source, target, shape,
                                dtype.name, size if shape is not None else 0))
    return sorted(out, key=lambda t: (t.direction != "forward", t.source, t.tensor))


def transfers_of(target, *args, session=None, feed_dict=None) -> list[Transfer]:
    """Run ``target`` once (a ``tf.function`` / callable with ``*args``, or TF1 fetches with
    ``session=``) and list the tensors it sent between devices."""
    if session is not None:
        opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
        meta = tf.compat.v1.RunMetadata()
        session.run(target, feed_dict=feed_dict, options=opts, run_metadata=meta)
        return _collect(meta.partition_graphs, session.graph)
    if not callable(target):
        raise ValueError(f"target must be a callable or tf.function (or pass session=), got "
                         f"{type(target).__name__}")
    fresh = target._clone(None) if hasattr(target, "_clone") else tf.function(target)  # noqa: SLF001
    concrete = fresh.get_concrete_function(*args)
    context.enable_run_metadata()
    try:
        context.export_run_metadata()
        fresh(*args)
        meta = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    graphs = [pg for fg in meta.function_graphs for pg in fg.partition_graphs]
    return _collect(graphs, concrete.graph)


def crossing_bytes(transfers: Sequence[Transfer]) -> dict[str, int]:
    """``{"forward": bytes, "backward": bytes, "total": bytes}`` of the data transfers."""
    out = {"forward": 0, "backward": 0}
    for t in transfers:
        if not t.control:
            out[t.direction] += t.nbytes
    out["total"] = out["forward"] + out["backward"]
    return out


def format_transfers(transfers: Sequence[Transfer], control: bool = False) -> str:
    """One line per transfer (control-only sends left out unless ``control``)."""
    rows = [t for t in transfers if control or not t.control]
    head = ("direction", "tensor", "from", "to", "shape", "bytes")
    body = [(t.direction, t.tensor, t.source, t.target,
             "?" if t.shape is None else str(list(t.shape)), str(t.nbytes)) for t in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip()
                     for r in [head, *body])


def traced_run(session, fetches, feed_dict=None):
    """``session.run`` with ``FULL_TRACE``: returns ``(result, run_metadata)``."""
    opts = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    meta = tf.compat.v1.RunMetadata()
    result = session.run(fetches, feed_dict=feed_dict, options=opts, run_metadata=meta)
    return result, meta


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def busy_intervals(step_stats, devices: Sequence[str] | None = None,
                   skip_ops: Sequence[str] = ("_SOURCE", "_Send", "_Recv", "_Retval", "_Arg")
                   ) -> dict[str, list[tuple[float, float]]]:
    """Busy time per device from a FULL_TRACE run's ``step_stats``: merged ``(start, end)``
    intervals in seconds from the first op of the step. ``devices`` (any spelling) keeps only
    those, in that order; ops named in ``skip_ops`` (bookkeeping) are not counted as work."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for dev in step_stats.dev_stats:
        name = short_device(dev.device)
        for node in dev.node_stats:
            if node.node_name in skip_ops or node.node_name.split(":")[0] in skip_ops \
                    or node.timeline_label.split(" = ")[-1].split("(")[0] in skip_ops:
                continue
            start = node.all_start_micros
            spans.setdefault(name, []).append((start, start + max(node.all_end_rel_micros, 1)))
    if not spans:
        raise ValueError("step_stats hold no ops: run with FULL_TRACE (traced_run)")
    t0 = min(s for v in spans.values() for s, _ in v)
    out = {d: [((a - t0) / 1e6, (b - t0) / 1e6) for a, b in _merge(v)] for d, v in spans.items()}
    if devices is None:
        return dict(sorted(out.items()))
    from accel.devices import normalize_device

    by_norm = {normalize_device(d): d for d in out}
    return {d: out.get(by_norm.get(normalize_device(d), ""), []) for d in devices}


def idle_fractions(intervals: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Each device's idle share of the step (from the first op's start to the last op's end
    on any device)."""
    ends = [b for v in intervals.values() for _, b in v]
    starts = [a for v in intervals.values() for a, _ in v]
    if not ends:
        raise ValueError("no busy intervals: nothing ran")
    span = max(ends) - min(starts)
    return {d: 1.0 - sum(b - a for a, b in v) / span for d, v in intervals.items()}
