"""accel.costmodel.model_parallel against hand calculations and the GPUs' data sheets' literal
figures."""

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


# the data sheets' memory per GPU in GB (DGX B200: 1,440 / 8; DGX B300: 2.3 TB / 8 = 288)
SHEETS = {"NVIDIA A100": 80, "NVIDIA H100 SXM": 80, "NVIDIA H200 SXM": 141, "NVIDIA B200": 180,
          "AMD MI300X": 192, "AMD MI325X": 256, "NVIDIA B300": 288, "AMD MI355X": 288}


def test_gpu_capacities_are_the_data_sheets():
    rows = mpc.gpu_capacities()
    assert {r["gpu"]: r["gb"] for r in rows} == SHEETS
    b300 = next(r for r in rows if r["gpu"] == "NVIDIA B300")
    assert b300["params"] == pytest.approx(0.8 * 288e9 / 16)  # 14.4 B within the budget
    assert mpc.gpu_capacities(budget=1.0)[-1]["params"] == pytest.approx(18e9)
    assert mpc.smallest_gpu(100) == "H200"       # 100 <= 0.8 x 141
    assert mpc.smallest_gpu(150) == "MI300X"     # above 0.8 x 180, below 0.8 x 192
    assert mpc.smallest_gpu(60) == "A100 / H100"
    assert mpc.smallest_gpu(231) == "none"       # above 0.8 x 288
    with pytest.raises(ValueError, match="budget"):
        mpc.gpu_capacities(budget=1.5)


def test_memory_rows_by_hand():
    s, b, h, a, n = 2048, 8, 4096, 32, 32
    params = n * (12 * h * h + 13 * h) + (32000 + s) * h  # Narayanan et al. eq. 2
    sbh, state = s * b * h, 16 * params
    row = mpc.memory_rows(gpus=(1,))[0]
    assert row["state"] == pytest.approx(state / 1e9)
    assert row["no recompute"] == pytest.approx((state + n * sbh * (34 + 5 * a * s / h)) / 1e9)
    # selective recomputation drops the 5as/h term (Korthikanti et al. Table 2): 34 sbh
    assert row["selective"] == pytest.approx((state + n * sbh * 34) / 1e9)
    assert row["fused attention"] == pytest.approx((state + n * sbh * (34 + 4 * a / h)) / 1e9)
    # full recomputation: every layer's input, plus one layer's whole set while it reruns
    assert row["full recompute"] == pytest.approx(
        (state + n * 2 * sbh + sbh * (34 + 5 * a * s / h)) / 1e9)
    two = mpc.memory_rows(gpus=(2,))[0]  # 16 layers and the embedding on the first GPU
    first = 16 * (12 * h * h + 13 * h) + (32000 + s) * h
    assert two["state"] == pytest.approx(16 * first / 1e9)


def test_time_rows_by_hand():
    params = mpc.EXAMPLE["model"].parameters
    rows = mpc.time_rows(gpus=(1, 2), links=("PCIe 5.0 x16",))
    compute = 6 * params * 8 * 2048 / (989.4e12 * 0.5)  # H100 SXM bf16 dense, half the peak
    assert rows[0]["compute_s"] == pytest.approx(compute)
    # one boundary: the [8 x 2048, 4096] bf16 activation forward and its gradient back
    assert rows[1]["transfer_s"] == pytest.approx(2 * 8 * 2048 * 4096 * 2 / 63e9)
