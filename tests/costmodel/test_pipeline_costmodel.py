"""accel.costmodel.pipeline: the model's arithmetic against hand calculations."""

import pytest

from accel.costmodel import pipeline as cp
from accel.costmodel import transformer as ct


def test_transformer_figures_by_hand():
    # s=2048, b=1, h=4096, a=32: 2048*4096*(34 + 5*32*2048/4096) = 2048*4096*114 bytes
    assert ct.layer_activation_bytes(batch=1, seq=2048, hidden=4096, heads=32) == \
        2048 * 4096 * 114
    # 3 * 24 * 1 * 2048 * 4096^2 * (1 + 2048 / 24576)
    assert ct.layer_flops(batch=1, seq=2048, hidden=4096) == pytest.approx(
        3 * 24 * 2048 * 4096**2 * (1 + 1 / 12))
    # Megatron-LM v1 leaves the scores out: 3 * 24 * b s h^2; recomputation is a fourth pass
    assert ct.layer_flops(1, 1, 10, attention_scores=False) == 7200
    assert ct.layer_flops(2, 8, 16, passes=4) == pytest.approx(
        4 / 3 * ct.layer_flops(2, 8, 16))


def test_pipeline_step_by_hand():
    e = cp.pipeline_step(0.01, 8, 4)
    assert e.step_s == pytest.approx(11 * 0.01) and e.bubble_s == pytest.approx(0.03)
    assert e.efficiency == pytest.approx(8 / 11)
    # 31.5e6 bytes each way over PCIe 4.0 x16 (31.5 GB/s): 2 ms per micro-batch and boundary
    e = cp.pipeline_step(0.01, 4, 2, boundary_bytes=31.5e6, link="PCIe 4.0 x16")
    assert e.transfer_s == pytest.approx(2e-3) and e.step_s == pytest.approx(5 * 0.012)
    assert cp.pipeline_step(0.01, 4, 1, 1e9, "PCIe 4.0 x16").transfer_s == 0.0


def test_microbatches_and_stash():
    assert cp.microbatches_for_efficiency(4, 0.8) == 12   # 12 / 15 = 0.8
    assert cp.microbatches_for_efficiency(2, 0.5) == 1
    assert cp.stash_microbatches("gpipe", 32, 4) == 32
    assert cp.stash_microbatches("1f1b", 32, 4) == 4
    assert cp.stash_microbatches("1f1b", 2, 8) == 2
    assert cp.gpu_stage_seconds(312e12 * 0.5) == pytest.approx(1.0)


@pytest.mark.parametrize("call, message", [
    (lambda: cp.pipeline_step(0.01, 4, 2, boundary_bytes=10), "needs a link"),
    (lambda: cp.pipeline_step(-1, 4, 2), "stage_s must be a number >= 0, got -1"),
    (lambda: cp.microbatches_for_efficiency(4, 1.0), r"target must be in \(0, 1\), got 1.0"),
    (lambda: cp.stash_microbatches("zb", 4, 4), "schedule must be one of .* got 'zb'"),
    (lambda: ct.layer_flops(1, 0, 8), "seq must be an int >= 1, got 0"),
    (lambda: ct.layer_flops(1, 1, 8, passes=0), "passes must be an int >= 1, got 0"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
