"""A cost model of a synchronous pipeline on real accelerators: stage time, the activations sent
between stages, the bubble, and the activation memory a schedule stashes. A MODEL, not a
measurement; figures come from ``accel.costmodel.hardware`` (cited there) or from you.

A transformer layer's FLOPs and activation bytes are ``accel.costmodel.transformer``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from accel import checks
from accel.costmodel.hardware import link_bandwidth, peak_flops

__all__ = ["PipelineEstimate", "pipeline_step", "microbatches_for_efficiency",
           "stash_microbatches", "gpu_stage_seconds"]


@dataclass(frozen=True)
class PipelineEstimate:
    """One modelled pipeline step (seconds) and what it implies."""

    step_s: float
    compute_s: float       # m x (stage time): the useful work of one stage
    bubble_s: float        # (p - 1) x (stage time + transfer)
    transfer_s: float      # per micro-batch and boundary: activations forward + gradients back

    @property
    def efficiency(self) -> float:
        """Useful share of the step: compute / step."""
        return self.compute_s / self.step_s


def pipeline_step(stage_s: float, num_microbatches: int, num_stages: int,
                  boundary_bytes: float = 0.0, link: str | None = None,
                  bandwidth_bps: float | None = None) -> PipelineEstimate:
    """A balanced synchronous pipeline (GPipe or 1F1B: same step time): ``stage_s`` is one
    stage's forward + backward time for one micro-batch; each micro-batch also sends
    ``boundary_bytes`` of activations forward and as many gradient bytes back over ``link``
    at every stage boundary (or at ``bandwidth_bps`` bytes/s if given instead of a link), not
    overlapped with compute (a pessimistic bound). The clock has ``m + p - 1`` slots of
    ``stage_s + transfer``."""
    checks.non_negative_number("stage_s", stage_s)
    checks.positive_int("num_stages", num_stages)
    checks.positive_int("num_microbatches", num_microbatches)
    checks.non_negative_number("boundary_bytes", boundary_bytes)
    if boundary_bytes and link is None and bandwidth_bps is None:
        raise ValueError("boundary_bytes > 0 needs a link (a key of hardware.LINKS) or "
                         "bandwidth_bps")
    if bandwidth_bps is None:
        bandwidth_bps = link_bandwidth(link) if boundary_bytes else 1.0
    bandwidth_bps = checks.positive_number("bandwidth_bps", bandwidth_bps)
    transfer = 2 * boundary_bytes / bandwidth_bps
    transfer = transfer if num_stages > 1 else 0.0
    slot = stage_s + transfer
    m, p = num_microbatches, num_stages
    return PipelineEstimate(step_s=(m + p - 1) * slot, compute_s=m * stage_s,
                            bubble_s=(p - 1) * slot, transfer_s=transfer)


def microbatches_for_efficiency(num_stages: int, target: float) -> int:
    """The fewest micro-batches whose pipeline keeps ``target`` of the clock busy:
    ``m / (m + p - 1) >= target``."""
    checks.positive_int("num_stages", num_stages)
    if not 0 < target < 1:
        raise ValueError(f"target must be in (0, 1), got {target!r}")
    m = 1
    while m / (m + num_stages - 1) < target:
        m += 1
    return m


def stash_microbatches(schedule: str, num_microbatches: int, num_stages: int) -> int:
    """How many micro-batches' activations the first stage holds at its peak: ``m`` under GPipe,
    ``min(p, m)`` under 1F1B and ZB-H1 (whose W keeps them until it runs: every stage holds
    ``min(p, m)``, Qi et al. 2023, arXiv:2401.10241, section 2.1) (counted exactly on the
    schedules by ``pipeline.peak_in_flight``)."""
    checks.one_of("schedule", schedule, ("gpipe", "1f1b", "zb-h1"))
    checks.positive_int("num_stages", num_stages)
    checks.positive_int("num_microbatches", num_microbatches)
    return num_microbatches if schedule == "gpipe" else min(num_stages, num_microbatches)


def gpu_stage_seconds(flops: float, device: str = "NVIDIA A100", precision: str = "bf16",
                      utilization: float = 0.5) -> float:
    """Seconds to do ``flops`` on ``device`` at ``utilization`` of its dense peak."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return checks.non_negative_number("flops", flops) / (peak_flops(device, precision)
                                                         * utilization)
