"""What a parameter-server run leaves behind: one record per gradient, and their analysis.

Versions count updates: the parameters start at version 0 and every applied update adds one.
A worker reads the parameters at ``read_version``; when its gradient reaches the server the
parameters are at ``applied_version``. The difference is the gradient's *staleness*: how many
updates other workers made while this one was computing. Synchronous training has staleness 0 by
construction; asynchronous training measures it. Analysing records needs only NumPy.

The server's decisions are pure functions of plain integers, so they can be read and tested
against written-out tables; ``accel.parallel.parameter_server``'s threads only call them:

* ``server_decision``: what happens to a gradient that arrives ("apply", "hold" or "drop");
  in ``hogwild`` (lock-free) nobody decides: every worker applies its own gradient;
* ``may_read``: whether a worker may read the parameters now;
* ``delayed_read_version``: which version gradient ``g`` reads in the controlled-delay loop;
* ``count_overlaps``: how many of a run's time spans overlapped another (lock-free updates that
  interleaved, reads that saw an update half done);
* ``first_reach``: when, after how many updates and gradients, a run's full-data loss first
  reached a target; ``race_summary``: those of repeated runs as medians, spreads and ratios.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from accel import checks

__all__ = ["MODES", "SYNC_MODES", "DECISIONS", "MODE_ONLY", "server_decision", "may_read",
           "check_train_arguments", "count_overlaps",
           "delayed_read_version", "UpdateRecord", "TrainResult", "staleness_histogram",
           "delay_schedule", "summarize", "TargetHit", "first_reach", "race_summary"]

MODES = ("sync", "k_of_n", "async", "hogwild", "delayed")
SYNC_MODES = ("sync", "k_of_n")  # updates average k gradients of the current version
DECISIONS = ("apply", "hold", "drop")
# keyword -> the modes that use it; any other mode refuses it
MODE_ONLY = {"k": ("k_of_n",), "delay": ("delayed",), "max_staleness": ("async", "delayed"),
              "warmup_steps": ("async", "delayed"), "staleness_lr": ("async", "delayed"),
              "slowdown": ("sync", "k_of_n", "async", "hogwild"),
              "step_time": ("sync", "k_of_n", "async", "hogwild"),
              "target_loss": ("sync", "k_of_n", "async", "delayed")}


def server_decision(mode: str, version: int, read_version: int, pending: int, k: int = 1,
                    max_staleness: int | None = None) -> str:
    """What the server does with a gradient computed at ``read_version`` that arrives when the
    parameters are at ``version`` and ``pending`` gradients of this version are already held.

    * ``sync`` / ``k_of_n``: a gradient of an older version is late ("drop"); otherwise it is
      held until it is the ``k``-th ("apply": average the ``k`` held gradients, one update).
      ``sync`` is ``k_of_n`` with ``k`` = the number of workers.
    * ``async`` / ``delayed``: every gradient is applied on arrival, unless ``max_staleness`` is
      set and the gradient is staler than that ("drop").
    * ``hogwild``: "apply", always (no server decides; each worker applies its own gradient).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    staleness = version - read_version
    if staleness < 0 or pending < 0 or k < 1:
        raise ValueError(f"need read_version <= version, pending >= 0 and k >= 1; got "
                         f"{version=}, {read_version=}, {pending=}, {k=}")
    if mode in SYNC_MODES:
        if staleness > 0:
            return "drop"
        return "apply" if pending + 1 >= k else "hold"
    if max_staleness is not None and staleness > max_staleness:
        return "drop"
    return "apply"


def may_read(mode: str, version: int, last_read: int, worker: int, warmup_steps: int = 0) -> bool:
    """Whether ``worker`` may read the parameters (at ``version``) for its next gradient.

    ``sync`` / ``k_of_n``: once per version: only if its last gradient was computed at an older
    version (``last_read`` < ``version``; -1 before its first). ``async`` / ``hogwild``: always,
    except during a warm-up of ``warmup_steps`` updates, when only worker 0 works.
    """
    if mode in SYNC_MODES:
        return last_read < version
    return worker == 0 or version >= warmup_steps


def delayed_read_version(version: int, delay: int, index: int, warmup_steps: int = 0) -> int:
    """The version gradient number ``index`` reads in the controlled-delay loop: ``delay``
    updates behind the current ``version`` (never before version 0), except during the first
    ``warmup_steps`` gradients, which read the current version."""
    return max(0, version - (0 if index < warmup_steps else delay))


@dataclass(frozen=True)
class UpdateRecord:
    """One gradient as the parameter server saw it.

    ``applied_version`` is the version the gradient met on arrival (before its update);
    ``dropped`` gradients (late in K-of-N, or too stale) were not applied. ``loss`` is the
    worker's mini-batch loss at the parameters it read; ``time`` is seconds since the run began;
    ``step`` counts the worker's own gradients (0, 1, ...): it used mini-batch
    ``batches[worker][step % len(batches[worker])]``.
    """

    worker: int
    read_version: int
    applied_version: int
    loss: float
    time: float
    examples: int
    dropped: bool = False
    step: int = 0

    @property
    def staleness(self) -> int:
        """Updates applied by others between this gradient's read and its arrival."""
        return self.applied_version - self.read_version


@dataclass
class TrainResult:
    """A finished run: final parameters (NumPy), the records in arrival order, and timings.

    ``curve`` lists ``(examples applied, full-data loss)`` pairs sampled during the run, and
    ``curve_time`` the seconds since the start at which each was sampled. ``wall_time`` runs
    from the start to the last *applied* update: a straggler's unfinished or dropped work after
    it does not count. ``hogwild`` runs also keep the ``(start, end)`` seconds of every update
    (``update_spans``) and of every read of the parameters (``read_spans``).
    """

    mode: str
    params: list[np.ndarray]
    records: list[UpdateRecord]
    wall_time: float
    final_loss: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    curve_time: list[float] = field(default_factory=list)
    update_spans: list[tuple[float, float]] = field(default_factory=list)
    read_spans: list[tuple[float, float]] = field(default_factory=list)

    @property
    def applied(self) -> list[UpdateRecord]:
        """The records of gradients that changed the parameters."""
        return [r for r in self.records if not r.dropped]

    @property
    def staleness(self) -> np.ndarray:
        """Staleness of every applied gradient, in arrival order."""
        return np.array([r.staleness for r in self.applied], dtype=np.int64)

    @property
    def examples(self) -> int:
        """Examples whose gradients were applied."""
        return sum(r.examples for r in self.applied)

    @property
    def examples_per_s(self) -> float:
        """Throughput: applied examples per second of wall time."""
        return self.examples / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def mean_loss(self) -> float:
        """Mean of the sampled full-data losses (``curve``): the area under the loss curve per
        sample, lower when training gets low sooner. NaN without a curve."""
        return float(np.mean([loss for _, loss in self.curve])) if self.curve else float("nan")

    def dropped_by_worker(self, num_workers: int) -> list[int]:
        """How many gradients of each worker were dropped."""
        counts = [0] * num_workers
        for r in self.records:
            if r.dropped:
                counts[r.worker] += 1
        return counts


def count_overlaps(spans: Sequence[tuple[float, float]],
                   others: Sequence[tuple[float, float]] | None = None) -> int:
    """How many ``(start, end)`` spans overlap (share more than an end point with) another span
    of ``spans``, or, if ``others`` is given, a span of ``others``."""
    bad = [s for s in [*spans, *(others or [])] if len(s) != 2 or s[1] < s[0]]
    if bad:
        raise ValueError(f"a span is (start, end) with start <= end, got {bad[0]!r}")
    pool = spans if others is None else others

    def hits(i, a):
        return any(a[0] < b[1] and b[0] < a[1] for j, b in enumerate(pool)
                   if others is not None or j != i)
    return sum(hits(i, a) for i, a in enumerate(spans))


def staleness_histogram(records: Sequence[UpdateRecord],
                        max_staleness: int | None = None) -> np.ndarray:
    """``counts[s]`` = number of applied gradients with staleness ``s`` (0..max seen)."""
    values = [r.staleness for r in records if not r.dropped]
    if any(v < 0 for v in values):
        raise ValueError(f"negative staleness in records: {min(values)}; versions are corrupt")
    top = max(values, default=0) if max_staleness is None else max_staleness
    return np.bincount(np.minimum(values, top), minlength=top + 1) if values else np.zeros(1, int)


def summarize(result: TrainResult) -> dict[str, float]:
    """Facts about a run: counts, staleness statistics, throughput and final loss."""
    s = result.staleness
    return {
        "gradients": len(result.records),
        "applied": len(s),
        "dropped": len(result.records) - len(s),
        "max_staleness": int(s.max()) if len(s) else 0,
        "mean_staleness": float(s.mean()) if len(s) else 0.0,
        "stale_fraction": float((s > 0).mean()) if len(s) else 0.0,
        "examples_per_s": result.examples_per_s,
        "final_loss": result.final_loss,
    }


def delay_schedule(steps: int, mean_delay: float, seed: int = 0) -> list[int]:
    """A reproducible list of ``steps`` delays, geometric with the given mean (0 allowed).

    Mimics the long-tailed staleness of real asynchronous runs for the deterministic
    controlled-delay loop (``accel.parallel.parameter_server.train_delayed``).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0 or mean_delay < 0:
        raise ValueError(f"steps must be an int >= 0 and mean_delay >= 0, got {steps=}, "
                         f"{mean_delay=}")
    rng = np.random.default_rng(seed)
    return [int(d) for d in rng.geometric(1.0 / (1.0 + mean_delay), size=steps) - 1]


def check_train_arguments(mode: str, num_workers: int, steps: int, k=None, delay=None,
                          slowdown=None, step_time=0.0, max_staleness=None, optimizer=0.1,
                          warmup_steps=0, eval_every=0, staleness_lr=False,
                          target_loss=None) -> list[int]:
    """Check the arguments of ``accel.parallel.parameter_server.train`` before any thread starts;
    return the per-gradient delays of the ``delayed`` mode ([] otherwise). An argument that
    ``mode`` does not use (see ``MODE_ONLY``) is a ``ValueError`` naming the modes that use it.
    """
    checks.one_of("mode", mode, MODES)
    given = {"k": k, "delay": delay, "max_staleness": max_staleness,
             "warmup_steps": warmup_steps or None, "slowdown": slowdown or None,
             "step_time": step_time or None, "staleness_lr": staleness_lr or None,
             "target_loss": target_loss}
    for name, value in given.items():
        if value is not None and mode not in MODE_ONLY[name]:
            raise ValueError(f"{name}={value!r} has no effect in mode {mode!r}; the modes "
                             f"that use {name}: {', '.join(MODE_ONLY[name])}")
    if num_workers < 1:
        raise ValueError("need at least one worker device, got none")
    checks.positive_int("steps", steps)
    if mode == "k_of_n" and not (isinstance(k, int) and 1 <= k <= num_workers):
        raise ValueError(f"k must be in 1..{num_workers} (the number of workers), got k={k!r}")
    delays = ([] if delay is None else [delay] * steps if np.ndim(delay) == 0
              else list(delay)[:steps])
    if mode == "delayed" and (len(delays) < steps or not all(
            isinstance(d, int | np.integer) and d >= 0 for d in delays)):
        raise ValueError(f"delay must be an int >= 0 or a list of {steps}+ of them, got {delay!r}")
    bad = {w: f for w, f in (slowdown or {}).items() if not (0 <= w < num_workers and f >= 1)}
    if bad:
        raise ValueError(f"slowdown maps a worker index < {num_workers} to a factor >= 1; "
                         f"bad: {bad}")
    checks.non_negative_number("step_time", step_time)
    checks.non_negative_int("warmup_steps", warmup_steps)
    checks.non_negative_int("eval_every", eval_every)
    if max_staleness is not None:
        checks.non_negative_int("max_staleness", max_staleness)
    if target_loss is not None:
        if not np.isfinite(checks.positive_number("target_loss", target_loss)):
            raise ValueError(f"target_loss must be a finite number > 0, got {target_loss!r}")
        if eval_every not in (0, 1):
            raise ValueError(f"target_loss evaluates the loss after every update; eval_every "
                             f"must be 0 or 1 with it, got {eval_every!r}")
    if staleness_lr and checks.learning_rate(optimizer) is None:
        raise ValueError(f"staleness_lr divides the learning rate of plain SGD by the staleness: "
                         f"optimizer must be a learning rate, got {type(optimizer).__name__}")
    if checks.learning_rate(optimizer) is None and mode == "hogwild":
        raise ValueError(f"hogwild applies plain SGD from several threads at once: optimizer "
                         f"must be a learning rate, got {type(optimizer).__name__}")
    return [int(d) for d in delays]


@dataclass(frozen=True)
class TargetHit:
    """When a run's full-data loss first reached a target: ``seconds`` after the start (the
    run's clock: the arrival of the gradient whose update got there), after ``updates`` applied
    updates made of ``examples`` examples; ``gradients`` counts every gradient that had reached
    the server by then, ``dropped`` those of them that were thrown away (late or too stale)."""

    seconds: float
    updates: int
    examples: int
    gradients: int
    dropped: int


def first_reach(result: TrainResult, target_loss: float) -> TargetHit | None:
    """The first sample of ``result.curve`` at or below ``target_loss`` as a ``TargetHit``
    (``None`` if the loss never got there). Exact when the run sampled the loss after every
    update (``eval_every=1`` or ``target_loss``); with sparser samples it is the first sample
    that got there. Not for ``hogwild`` runs, whose records are written after the update and
    whose versions may repeat."""
    checks.positive_number("target_loss", target_loss)
    if result.mode == "hogwild":
        raise ValueError("first_reach reads a parameter server's records; a hogwild run's "
                         "versions are counted by concurrent workers and may repeat")
    if len(result.curve) != len(result.curve_time):
        raise ValueError(f"curve has {len(result.curve)} samples but curve_time "
                         f"{len(result.curve_time)}; they come from one run")
    for (examples, loss), seconds in zip(result.curve, result.curve_time, strict=True):
        if loss <= target_loss:
            arrived = [r for r in result.records if r.time <= seconds]
            updates = len({r.applied_version for r in arrived if not r.dropped})
            dropped = sum(r.dropped for r in arrived)
            return TargetHit(float(seconds), updates, int(examples), len(arrived), dropped)
    return None


def race_summary(hits: dict[str, Sequence[TargetHit | None]],
                 baseline: str) -> dict[str, dict[str, float]]:
    """Repeated runs to a target, per variant: ``hits[name][r]`` is repetition ``r``'s
    ``TargetHit`` (``None``: never reached; it counts as infinitely late). Returns per variant
    the median, ``min`` and ``max`` seconds, ``ratio``: the median over repetitions of its
    seconds over ``baseline``'s in the same repetition (so that a slow moment of the machine
    hits both sides of each ratio), and the medians of ``updates``, ``examples``, ``gradients``
    and ``dropped`` over the repetitions that reached the target, with ``reached`` counting
    them."""
    if baseline not in hits:
        raise ValueError(f"baseline {baseline!r} is not one of {list(hits)}")
    counts = {len(v) for v in hits.values()}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every variant needs the same number (> 0) of repetitions, got "
                         f"{ {k: len(v) for k, v in hits.items()} }")

    def seconds(name):
        return np.array([np.inf if h is None else h.seconds for h in hits[name]])

    base = seconds(baseline)
    out = {}
    for name, runs in hits.items():
        s = seconds(name)
        done = [h for h in runs if h is not None]
        row = {"median": float(np.median(s)), "min": float(s.min()), "max": float(s.max()),
               "reached": len(done)}
        with np.errstate(divide="ignore", invalid="ignore"):  # never reached: inf / inf
            row["ratio"] = float(np.median(s / base))
        for key in ("updates", "examples", "gradients", "dropped"):
            row[key] = float(np.median([getattr(h, key) for h in done])) if done else np.nan
        out[name] = row
    return out
