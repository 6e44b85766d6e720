"""``python -m accel bench allreduce``: chapter 13's measurements as ratios from one run.

Across processes, the hand ring vs TensorFlow's RING collective (goal: within 1.1x at every
size >= 1 MiB) and, on four processes, the alpha-beta model checked against the hand ring,
tree and through-one-device (``accel.course.collectives``); in one process, every hand
algorithm vs TensorFlow's cross-device ops, packing by hand and by ``CommunicationOptions``
(``accel.course.traffic``), float16 vs float32, and bytes per device vs the formulas (exact).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accel import collectives, timing
from accel.course.collectives import (
    bytes_table,
    crossover_lines,
    inprocess_times,
    placed,
    process_lines,
    sweep,
)
from accel.course.traffic import packing_times, tf_packing

__all__ = ["bench"]


def bench(device_names: Sequence[str], quick: bool = False) -> dict:
    """Across processes: hand ring vs TF's RING collective (goal within 1.1x at every size
    >= 1 MiB); in one process: every algorithm vs TF's; packed vs unpacked; float16 vs
    float32; bytes per device vs the formulas (exact)."""

    devs = list(device_names)
    count = 1024 if quick else 1 << 20
    repeat = 2 if quick else 5
    out: dict = {}
    lines = [f"in one process, {len(devs)} logical CPUs, {4 * count} bytes each (overhead, "
             "not bandwidth: the devices share memory); ratios against the hand ring"]
    times = inprocess_times(devs, count, repeat)
    lines.append(timing.format_ratios(times, "ring"))
    out.update({f"inprocess {k}/ring": v / times["ring"] for k, v in times.items()})
    rows = bytes_table(devs, count // 4 + 1)
    exact = all(c == f for _, c, f in rows)
    out["bytes exact"] = exact
    for alg, counted, formula in rows:
        lines.append(f"bytes sent per device, {alg:16}: counted {counted}, formula {formula}")
    lines.append(f"counted == formula for every algorithm: {exact}")
    tensors = 16 if quick else 64
    for label, key, pack in (
            ("packing by hand, pack_bytes", 0, packing_times(devs, tensors, 256, repeat=repeat)),
            ("TF collective, bytes_per_pack", 1, tf_packing(devs, tensors, 256, repeat=repeat))):
        base = pack[key][0]  # one all-reduce per tensor
        for p, (t, calls) in pack.items():
            out[f"{label} {p}/unpacked"] = t / base
            lines.append(f"{label} {p:>10}: {calls:3} all-reduces, {t * 1e3:8.2f} ms, "
                         f"{t / base:.2f}x unpacked")
    xs = placed(devs, count)
    t32 = timing.time_fn(tf.function(lambda: [y[:1] for y in collectives.all_reduce(
        xs, devs, "ring")], autograph=False), repeat)
    t16 = timing.time_fn(tf.function(lambda: [y[:1] for y in collectives.compressed_all_reduce(
        xs, devs)], autograph=False), repeat)
    b32 = collectives.sent_bytes(lambda xs: collectives.all_reduce(xs, devs, "ring"), xs)
    b16 = collectives.sent_bytes(lambda xs: collectives.compressed_all_reduce(xs, devs), xs)
    out["fp16/fp32 time"], out["fp16/fp32 bytes"] = t16 / t32, max(b16.values()) / max(
        b32.values())
    lines.append(f"float16 vs float32 ring: time {out['fp16/fp32 time']:.2f}x, bytes "
                 f"{out['fp16/fp32 bytes']:.2f}x")
    if quick:
        lines.append("processes: skipped with quick=True (start-up alone takes seconds)")
    else:
        worst = 0.0
        for workers in (2, 4):
            others = ("tree", "binomial", "halving_doubling", "one_device") if workers == 4 else ()
            result = sweep(workers, others=others)
            procs_lines, ratios = process_lines(result)
            lines += procs_lines
            out.update({f"procs{workers} {s} hand/tf": r for s, r in ratios.items()})
            worst = max([worst] + [r for s, r in ratios.items() if s >= 1 << 20])
            if others:
                lines += crossover_lines(result)[0]
        lines.append(f"goal: hand ring within 1.1x of TF's RING at every size >= 1 MiB -> "
                     f"worst {worst:.2f}x ({'met' if worst <= 1.1 else 'NOT met'})")
    lines.append(timing.ceiling_line() + "; virtual CPUs share these cores")
    print("\n".join(lines))
    return out
