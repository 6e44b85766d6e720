"""Chapter 14: what each worker reads, what a checkpoint interval costs, the exercises.

``input_table`` turns the workers' input reports (``accel.distributed.strategies.input_report``)
into printable rows. The checkpoint-interval models: ``young_interval`` (Young 1974, first
order), ``daly_interval`` (Daly 2006, higher order) and ``lost_fraction`` (Daly's expected wall
time for exponentially distributed failures, saves and restarts that can themselves be
interrupted), and the worked example's numbers (Llama 3 405B's checkpoint on Llama 3's storage,
its failure rate). ``check_scale``, ``check_backup_every_2_batches`` and
``check_restart_on_fewer_workers`` check the chapter's exercises (solutions in
``tests/course/test_strategies.py``).
"""

from __future__ import annotations

import math

from accel import checks

__all__ = ["input_table", "compact", "young_interval", "daly_interval", "lost_fraction",
           "check_scale", "check_backup_every_2_batches", "check_restart_on_fewer_workers",
           "MTBF_16K", "SAVE_STALL", "RESTART"]

# The worked example of chapter 14, section 5. Llama 3 ("The Llama 3 Herd of Models", 2024):
# 419 unexpected interruptions in 54 days on 16,384 H100s (section 3.3.4); storage sustains
# 2 TB/s (section 3.3.1). A checkpoint of the 405B model: fp32 weights and Adam's two fp32
# moments (12 bytes) plus bf16 weights (2 bytes) per parameter.
MTBF_16K = 54 * 24 * 3600 / 419
SAVE_STALL = 405e9 * 14 / 2e12
RESTART = 600.0

def compact(records: list[str]) -> str:
    """``["f0:0", "f0:1", "f2:0"]`` -> ``"f0:0-1 f2:0"``: records grouped by file."""
    groups: dict[str, list[str]] = {}
    for rec in records:
        name, _, index = rec.partition(":")
        groups.setdefault(name, []).append(index)
    parts = []
    for name, idx in groups.items():
        run = idx[0] if len(idx) == 1 else (
            f"{idx[0]}-{idx[-1]}" if [int(i) for i in idx] == list(
                range(int(idx[0]), int(idx[-1]) + 1)) else ",".join(idx))
        parts.append(f"{name}:{run}")
    return " ".join(parts)


def input_table(reports: list[dict], keys: tuple[str, ...]) -> list[str]:
    """One line per ``key`` (``"function"``, ``"FILE"``, ...): what each worker read."""
    width = max(len(k) for k in keys)
    return [f"{k.ljust(width)}  " + " | ".join(
        f"worker {w}: {compact(r['input'][k])}" for w, r in enumerate(reports)) for k in keys]


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's optimal compute time between checkpoints, ``sqrt(2 * save * MTBF)`` seconds
    (J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM
    17(9), 1974): a save every ``tau`` costs ``save / tau`` of the time, a failure loses
    ``tau / 2`` of work on average, once per MTBF; the sum is least at this ``tau``."""
    checks.positive_number("save_seconds", save_seconds)
    checks.positive_number("mtbf_seconds", mtbf_seconds)
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", FGCS 22(3), 2006):
    ``sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d`` for a save of ``d`` seconds
    shorter than ``2M``, else ``M`` (the MTBF)."""
    checks.positive_number("save_seconds", save_seconds)
    checks.positive_number("mtbf_seconds", mtbf_seconds)
    d, m = save_seconds, mtbf_seconds
    if d >= 2.0 * m:
        return m
    xi = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(xi) / 3.0 + xi / 9.0) - d


def lost_fraction(interval_seconds: float, save_seconds: float, restart_seconds: float,
                  mtbf_seconds: float) -> float:
    """The fraction of wall time that is not useful training when checkpointing every
    ``interval_seconds`` of compute, each save stalling training ``save_seconds``, each failure
    costing ``restart_seconds`` plus the work since the last save, failures arriving at random
    (exponentially) every ``mtbf_seconds`` on average, during saves and restarts too.
    Daly (2006): a segment of ``tau`` compute and its save take on average
    ``M * exp(R / M) * (exp((tau + d) / M) - 1)`` seconds of wall time; the rest is
    ``1 - tau / that``."""
    checks.positive_number("interval_seconds", interval_seconds)
    checks.non_negative_number("save_seconds", save_seconds)
    checks.non_negative_number("restart_seconds", restart_seconds)
    checks.positive_number("mtbf_seconds", mtbf_seconds)
    m = mtbf_seconds
    wall = m * math.exp(restart_seconds / m) * math.expm1((interval_seconds + save_seconds) / m)
    return 1.0 - interval_seconds / wall


def check_scale(answer) -> str:
    """Exercise 1: the worked example (plain saves stalling ``SAVE_STALL`` s, a restart of
    ``RESTART`` s) on 2x and 8x the GPUs, whose MTBF is then ``MTBF_16K / 2`` and ``/ 8``
    (independent failures: the rate adds up over the GPUs), each at Young's interval:
    ``(lost_at_2x, lost_at_8x)``, the fractions of time lost, within 0.01."""
    if answer is None or answer is ...:
        return "exercise 1: not answered yet"
    try:
        given = tuple(float(a) for a in answer)
    except (TypeError, ValueError):
        return f"exercise 1: give two fractions (lost_at_2x, lost_at_8x), got {answer!r}"
    if len(given) != 2:
        return f"exercise 1: give two fractions (lost_at_2x, lost_at_8x), got {answer!r}"
    want = []
    for scale in (2, 8):
        mtbf = MTBF_16K / scale
        want.append(lost_fraction(young_interval(SAVE_STALL, mtbf), SAVE_STALL, RESTART, mtbf))
    if all(abs(g - w) <= 0.01 for g, w in zip(given, want, strict=True)):
        return "exercise 1: correct"
    return (f"exercise 1: not {answer}: divide the MTBF by the scale, re-optimise the interval "
            f"with young_interval, then call lost_fraction (fractions, not percentages)")


def check_backup_every_2_batches(answer) -> str:
    """Exercise 2: ``BackupAndRestore(save_freq=2)``, ``fit`` interrupted after batch 6 of 12
    (4 batches per epoch), resumed: does it end bit for bit on the uninterrupted weights?
    No: the backup after batch 6 holds weights from the middle of epoch 2, but Keras 3 restarts
    ``fit`` at the start of the saved epoch, so batches 5 and 6 are applied a second time on
    top of weights that already contain them."""
    return _check_false(2, answer, "look at what the backup holds after batch 6 (which "
                        "weights, which epoch) and at which batch the second fit begins")


def check_restart_on_fewer_workers(answer) -> str:
    """Exercise 3: a checkpoint written at step 2 by two synchronous replicas, restored by ONE
    device that runs steps 3 to 6 on whole global batches: bit for bit the uninterrupted
    two-replica run? No, only within rtol 1e-5: the weights and step count restore exactly, but
    from step 3 on one device computes each global batch's gradient in one sum where two
    replicas added two half-batch sums, and float addition is not associative."""
    return _check_false(3, answer, "the checkpoint restores exactly, but compare how the "
                        "gradient of steps 3 to 6 is summed on one device and on two replicas")


def _check_false(number: int, answer, hint: str) -> str:
    """The verdict on a True/False exercise whose answer is False; ``hint`` follows a True."""
    if answer is None or answer is ...:
        return f"exercise {number}: not answered yet"
    if answer is False:
        return f"exercise {number}: correct"
    if answer is True:
        return f"exercise {number}: not True: {hint}"
    return f"exercise {number}: answer True or False, got {answer!r}"
