"""Figures of chapters 01-03, drawn from live TensorFlow data (devices, placements, kernels)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from accel.devices import device_table
from accel.kernels import data_attr, registered_kernels
from accel.placement import Placement, placement_of
from accel.viz import device_colors

__all__ = ["figure_devices", "figure_placement", "demo_placement",
           "kernel_coverage", "format_kernel_coverage", "KERNEL_OPS"]


def _box(ax, x, y, text, color, w=2.6, h=0.6):
    ax.add_patch(plt.Rectangle((x, y - h / 2), w, h, facecolor=color, edgecolor="black", lw=0.6))
    ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=8)


def figure_devices():
    """Physical devices (left) and the logical devices TensorFlow built from them (right)."""
    rows = device_table()
    phys = [r for r in rows if r.level == "physical"]
    logi = [r for r in rows if r.level == "logical"]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.55 * max(len(phys), len(logi))))
    colors = {"CPU": "#C6DBEF", "GPU": "#C7E9C0"}
    for i, r in enumerate(phys):
        _box(ax, 0, -i, f"{r.name}", colors.get(r.device_type, "#EEEEEE"), w=3.4)
    for j, r in enumerate(logi):
        _box(ax, 5, -j, r.name, colors.get(r.device_type, "#EEEEEE"))
        src = next((i for i, p in enumerate(phys) if p.device_type == r.device_type), 0)
        ax.annotate("", xy=(5, -j), xytext=(3.4, -src),
                    arrowprops={"arrowstyle": "->", "lw": 0.7, "color": "grey"})
    ax.text(1.7, 0.75, "physical (what the machine has)", ha="center", fontsize=9)
    ax.text(6.3, 0.75, "logical (what ops are placed on)", ha="center", fontsize=9)
    ax.set_xlim(-0.2, 7.8)
    ax.set_ylim(-max(len(phys), len(logi)) + 0.3, 1.1)
    ax.axis("off")
    fig.tight_layout()
    return fig


def demo_placement() -> Placement:
    """Chapter 02's example: inputs scaled on /cpu:0, added on /cpu:1, sin on /cpu:2.

    The inputs are function arguments, not constants: a graph of constants only is folded into
    one constant by Grappler before placement, and the requested devices disappear with it.
    """
    import tensorflow as tf

    @tf.function(autograph=False)
    def program(x, y):
        with tf.device("/cpu:0"):
            a, b = tf.multiply(x, 2.0, name="a"), tf.multiply(y, 3.0, name="b")
        with tf.device("/cpu:1"):
            c = tf.add(a, b, name="c")
        with tf.device("/cpu:2"):
            return tf.math.sin(c, name="d")

    return placement_of(program, tf.constant([1.0, 2.0, 3.0]), tf.constant([1.0, 1.0, 1.0]))


def figure_placement(placement: Placement | None = None, hide: Sequence[str] = ("_Retval",)):
    """Ops grouped in one column per device (op types in ``hide`` not drawn); one arrow per pair
    of devices with copies between them, labelled with the tensors it carries (each a ``_Send``
    -> ``_Recv`` pair). The title counts the ops drawn and the copies."""
    placement = placement or demo_placement()
    devices = placement.devices()
    shown = {d: sorted((r for r in placement.ops_on(d) if r.op_type not in hide),
                       key=lambda r: r.name) for d in devices}
    fig, ax = plt.subplots(figsize=(2.8 * len(devices), 1.2 + 0.45 * max(
        len(ops) for ops in shown.values())))
    colors = device_colors(devices)
    for col, dev in enumerate(devices):
        ax.text(col * 3 + 1.2, 0.7, dev, ha="center", fontsize=9, weight="bold")
        for i, r in enumerate(shown[dev]):
            _box(ax, col * 3, -i * 0.8, f"{r.name} ({r.op_type})", colors[dev], w=2.4, h=0.55)
    carried: dict[tuple[str, str], list[str]] = {}
    for t in placement.sends:
        carried.setdefault((t.source, t.target), []).append(t.tensor.removesuffix(":0"))
    for (src, dst), tensors in carried.items():
        start, end = devices.index(src) * 3 + 2.4, devices.index(dst) * 3
        ax.annotate("", xy=(end, 0.35), xytext=(start, 0.35),
                    arrowprops={"arrowstyle": "->", "color": "#C44E52", "lw": 1.2,
                                "connectionstyle": "arc3,rad=-0.25"})
        ax.text((start + end) / 2, 1.0, ", ".join(sorted(tensors)), ha="center", fontsize=8,
                color="#C44E52")
    ax.set_xlim(-0.3, 3 * len(devices))
    ax.set_ylim(-0.8 * max(len(ops) for ops in shown.values()), 1.35)
    ax.axis("off")
    hidden = len(placement) - sum(len(ops) for ops in shown.values())
    ax.set_title(f"{len(placement) - hidden} ops drawn on {len(devices)} devices"
                 + (f" ({', '.join(hide)} not drawn)" if hidden else "")
                 + f", {len(placement.transfers)} copies", fontsize=10)
    fig.tight_layout()
    return fig


KERNEL_OPS = ("VariableV2", "AssignAddVariableOp", "MatMul", "Conv2D", "StringJoin",
              "DecodeJpeg", "Unique", "UniqueV2", "TopKV2")


def kernel_coverage(op_type: str, device_type: str) -> int | str:
    """What ``op_type`` can run with on ``device_type``: the number of dtypes of its data
    attribute with a kernel; ``"every dtype"`` where one kernel is registered without a dtype
    constraint (a catch-all, like ``VariableV2``'s single CPU kernel); ``"fixed types"`` for an op
    without a type attribute (``StringJoin`` takes strings only), which has a kernel there.

    A GPU also counts the DEFAULT kernels, which TensorFlow uses on a GPU when no GPU kernel
    matches (``Unique`` on strings gets one that keeps its tensors in host memory)."""
    table = registered_kernels(op_type)
    found = set(table.get(device_type, []))
    if device_type == "GPU":
        found |= set(table.get("DEFAULT", []))
    if not found:
        return 0
    if data_attr(op_type) is None:
        return "fixed types"
    return "every dtype" if "any" in found else len(found)


def format_kernel_coverage(ops: Sequence[str] = KERNEL_OPS,
                           device_types: Sequence[str] = ("CPU", "GPU")) -> str:
    """``kernel_coverage`` of each op as an aligned table ("no kernel" for 0)."""
    def cell(value):
        return "no kernel" if value == 0 else f"{value} dtypes" if isinstance(value, int) \
            else value
    rows = [["op", *device_types]] + [[op, *(cell(kernel_coverage(op, d)) for d in device_types)]
                                      for op in ops]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)
