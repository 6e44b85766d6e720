"""Generic plots: bars of ratios, curves, timelines, a colour per device. Each chapter's figure
is built from these by a function of ``accel.course`` (registered for ``make images`` in
``accel.course.registry``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

__all__ = ["bars", "curves", "timeline", "device_colors"]

_PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def device_colors(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per device name (the same device gets the same colour in every plot)."""
    return {n: _PALETTE[i % len(_PALETTE)] for i, n in enumerate(sorted(set(names)))}


def bars(values: Mapping[str, float], ylabel: str, title: str = "", ax=None,
         baseline: str | None = None):
    """A bar per entry; with ``baseline`` the bars are ratios to that entry (a line marks 1.0)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    keys = list(values)
    vals = [values[k] for k in keys]
    if baseline is not None:
        if baseline not in values:
            raise ValueError(f"baseline {baseline!r} is not one of {keys}")
        vals = [v / values[baseline] for v in vals]
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.bar(keys, vals, color=_PALETTE[: len(keys)])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax.figure


def curves(series: Mapping[str, Sequence[float]], xlabel: str, ylabel: str, title: str = "",
           ax=None, x: Sequence[float] | None = None, logy: bool = False):
    """One line per named series (same x for all, default 0..n-1)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    for i, (label, ys) in enumerate(series.items()):
        xs = list(x) if x is not None else list(range(len(ys)))
        ax.plot(xs, list(ys), label=label, color=_PALETTE[i % len(_PALETTE)])
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def timeline(intervals: Sequence[tuple[str, float, float, str]], title: str = "", ax=None,
             xlabel: str = "time"):
    """A Gantt chart: ``(lane, start, end, label)`` per interval, one row per lane."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len({i[0] for i in intervals})))
    lanes = list(dict.fromkeys(i[0] for i in intervals))
    colors = device_colors([i[3] for i in intervals])
    for lane, start, end, label in intervals:
        if end < start:
            raise ValueError(f"interval {label!r} on {lane!r}: end {end} < start {start}")
        y = lanes.index(lane)
        ax.barh(y, end - start, left=start, color=colors[label], edgecolor="black", lw=0.4)
        ax.text(start + (end - start) / 2, y, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax.figure
