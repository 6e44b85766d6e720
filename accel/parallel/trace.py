"""What a multi-device step did, read from what TensorFlow executed: the tensors that crossed
between devices (with their bytes) and when each device was busy.

* ``transfers_of(fn, *args)`` / ``transfers_of(fetches, session=sess)``: run once and list every
  tensor sent from one device to another (the partition graphs' ``_Send`` nodes), with its
  shape, dtype and bytes; ``Transfer.direction`` says "forward" or "backward" (a tensor made by a
  gradient op: ``gradient_tape/...`` in TF2, ``gradients/...`` in TF1, or under a ``backward``
  name scope). Sends that only carry a
  control edge are listed with ``control=True`` and 0 bytes.
* ``crossing_bytes(transfers)``: bytes per direction; ``format_transfers``: a printable table.
* ``busy_intervals(run_metadata)``: the ops of a ``FULL_TRACE`` run (``accel.profile.traced_run``;
  read by ``accel.profile.step_intervals``, the package's one reader of step stats) merged into
  busy time per device, in seconds; ``idle_fractions`` says which share of the step each device
  waited. (``tf.timestamp()`` inside a ``tf.function`` would serialise the step it measures.)

Between logical devices of one process a "transfer" shares the buffer instead of copying it, so
the bytes here are logical: what a real link between two GPUs would have to carry.
"""

from __future__ import annotations

from collections.abc import Sequence

from accel.devices import normalize_device
from accel.placement import Transfer, placement_of
from accel.profile import step_intervals

__all__ = ["transfers_of", "crossing_bytes", "format_transfers", "busy_intervals",
           "idle_fractions"]


def transfers_of(target, *args, session=None, feed_dict=None) -> list[Transfer]:
    """Run ``target`` once (a ``tf.function`` / callable with ``*args``, or TF1 fetches with
    ``session=``) and list the tensors it sent between devices, forward ones first
    (``accel.placement.placement_of``'s ``sends``)."""
    ran = placement_of(target, *args, session=session, feed_dict=feed_dict)
    return sorted(ran.sends, key=lambda t: (t.direction != "forward", t.source, t.tensor))


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


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def busy_intervals(run_metadata, devices: Sequence[str] | None = None,
                   skip_ops: Sequence[str] = ("_SOURCE", "_Send", "_Recv", "_Retval", "_Arg")
                   ) -> dict[str, list[tuple[float, float]]]:
    """Busy time per device of a ``FULL_TRACE`` run (``accel.profile.traced_run``): merged
    ``(start, end)`` intervals in seconds from the first op of the step. ``devices`` (any
    spelling) keeps only those, in that order; ops whose name or type is in ``skip_ops``
    (bookkeeping) are not counted as work."""
    try:
        ops = step_intervals(run_metadata, skip=())
    except ValueError:
        ops = []
    spans: dict[str, list[tuple[float, float]]] = {}
    for op in ops:
        if op.name in skip_ops or op.name.split(":")[0] in skip_ops or op.op_type in skip_ops:
            continue
        spans.setdefault(op.lane, []).append((op.start, max(op.end, op.start + 1e-3)))
    if not spans:
        raise ValueError("the run holds no step stats: run with FULL_TRACE "
                         "(accel.profile.traced_run)")
    t0 = min(s for v in spans.values() for s, _ in v)
    out = {d: [((a - t0) / 1e3, (b - t0) / 1e3) for a, b in _merge(v)] for d, v in spans.items()}
    if devices is None:
        return dict(sorted(out.items()))
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
