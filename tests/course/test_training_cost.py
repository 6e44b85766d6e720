"""Chapter 01's cost arithmetic checked against independent figures: PaLM's published MFU (its
paper's Section 4.1 prints 46.2%, 45.7% without attention), a hand count of the transformer
FLOPs, and the GPU table's rows picked by name from the data-sheet peaks."""

import pytest

from accel.costmodel import hardware
from accel.course import training_cost


def test_model_flops_per_token_by_hand():
    # a toy transformer: 6 N for the weights, 12 L H Q T for attention, counted by hand
    assert training_cost.model_flops_per_token(1000.0, 2, 3, 4, 5) == 6 * 1000 + 12 * 2 * 3 * 4 * 5
    assert training_cost.model_flops_per_token(1000.0, 2, 3, 4, 5, attention=False) == 6000


def test_palm_mfu_is_the_papers():
    palm = training_cost.PALM_540B
    for attention, published in ((True, palm["published_mfu"]),
                                 (False, palm["published_mfu_without_attention"])):
        per_token = training_cost.model_flops_per_token(**palm["model"], attention=attention)
        got = training_cost.mfu(palm["tokens_per_s"], per_token, palm["chips"],
                                palm["peak_flops"])
        assert round(got, 3) == published


def test_mfu_is_model_flops_over_summed_peak():
    # 100 tokens/s x 1e12 FLOPs/token on 4 chips of 1e14 FLOP/s: 1e14 / 4e14
    assert training_cost.mfu(100, 1e12, 4, 1e14) == pytest.approx(0.25)


@pytest.mark.parametrize("kwargs", [
    {"tokens_per_second": 0, "flops_per_token": 1.0, "chips": 1, "peak_flops_per_chip": 1.0},
    {"tokens_per_second": 1.0, "flops_per_token": -1, "chips": 1, "peak_flops_per_chip": 1.0},
    {"tokens_per_second": 1.0, "flops_per_token": 1.0, "chips": 1.5, "peak_flops_per_chip": 1.0},
    {"tokens_per_second": 1.0, "flops_per_token": 1.0, "chips": 1, "peak_flops_per_chip": 0},
])
def test_mfu_refuses_bad_input(kwargs):
    with pytest.raises(ValueError):
        training_cost.mfu(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"params": 0}, {"layers": 0}, {"heads": 2.0}, {"head_dim": -1}, {"seq_len": True},
    {"attention": 1},
])
def test_model_flops_per_token_refuses_bad_input(kwargs):
    args = {"params": 1e9, "layers": 2, "heads": 2, "head_dim": 8, "seq_len": 16, **kwargs}
    with pytest.raises(ValueError):
        training_cost.model_flops_per_token(**args)


def test_gpu_rows_by_name_follow_the_data_sheets():
    names = ["NVIDIA V100", "NVIDIA A100"]
    rows = training_cost.gpu_rows(1e18, 0.5, names=names)
    assert [r.name for r in rows] == names
    v100, a100 = rows
    # the V100 has no TF32: a float32 run gets FP32; the A100's gets TF32 (its data sheet)
    assert (v100.float32_run, v100.float32_unit, v100.mixed) == (15.7, "FP32", 125.0)
    assert (a100.float32_run, a100.float32_unit, a100.mixed) == (156.0, "TF32", 312.0)
    # days = work / (utilisation x peak) / 86400
    assert a100.days_mixed == pytest.approx(1e18 / (0.5 * 312e12) / 86400)
    assert [r.name for r in training_cost.gpu_rows(1e18)] == list(hardware.PEAK_TFLOPS)


@pytest.mark.parametrize("names", ["NVIDIA A100", ["NVIDIA Z9000"]])
def test_gpu_rows_refuses_unknown_names(names):
    with pytest.raises(ValueError):
        training_cost.gpu_rows(1e18, names=names)
