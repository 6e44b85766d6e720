"""accel.costmodel.model_parallel against hand calculations."""

import pytest

from accel.costmodel import model_parallel as mpc


def test_naive_split_by_hand():
    # 1e9 params, 1000 tokens: 6e12 FLOPs at 312 TFLOP/s (A100 bf16) x 0.5 -> 6e12 / 156e12 s
    r = mpc.naive_split(1e9, 1000, 1000, 4, "PCIe 4.0 x16")
    assert r["compute_s"] == pytest.approx(6e12 / 156e12)
    # 3 boundaries x 2 directions x 1000 x 1000 x 2 bytes at 31.5 GB/s
    assert r["transfer_s"] == pytest.approx(6 * 2e6 / 31.5e9)
    step = r["compute_s"] + r["transfer_s"]
    assert r["idle_fraction"] == pytest.approx(1 - r["compute_s"] / (4 * step))
    assert r["memory_per_gpu_gb"] == pytest.approx(16e9 / 4 / 1e9)
    assert r["expected_idle"] == 0.75


def test_idle_tends_to_p_minus_one_over_p_and_one_gpu_does_not_fit():
    rows = mpc.example_rows()
    assert [r["gpus"] for r in rows] == [1, 2, 4, 1, 2, 4]
    assert rows[0]["memory_per_gpu_gb"] > mpc.A100_MEMORY_GB >= rows[1]["memory_per_gpu_gb"]
    for r in rows:
        assert r["idle_fraction"] == pytest.approx(r["expected_idle"], abs=0.01)
    assert rows[2]["transfer_s"] > rows[5]["transfer_s"]  # PCIe slower than NVLink
    assert "NVLink 3" in mpc.format_rows(rows)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_gpus": 0}, "num_gpus must be an int >= 1, got 0"),
    ({"utilization": 1.5}, r"utilization must be in \(0, 1\], got 1.5"),
    ({"link": "carrier pigeon"}, "link")])
def test_bad_input(kwargs, message):
    args = {"params": 1e9, "tokens": 10, "hidden": 10, "num_gpus": 2, "link": "PCIe 4.0 x16"}
    with pytest.raises(ValueError, match=message):
        mpc.naive_split(**{**args, **kwargs})

