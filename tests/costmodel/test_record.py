"""The hardware recorder: figures against hand counts (an injected clock), the data-sheet
lookup against literal tables, records read back, and the command line without TensorFlow."""

import json
import subprocess
import sys

import numpy as np
import pytest

from accel.costmodel import hardware, record


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _TimedNumpy(record.NumpyBackend):
    """NumPy's real products and copies, on a clock that each one advances by a known time:
    a product of n x n takes n^3 * 1e-12 s (so 2 TFLOP/s exactly), a copy of B bytes
    B / 1e10 s (so 20 GB/s counting bytes read and written)."""

    def __init__(self):
        self.fake = _FakeClock()
        super().__init__(clock=self.fake)

    def matmul(self, n, precision):
        run = super().matmul(n, precision)

        def timed():
            self.fake.now += n**3 * 1e-12
            return run()

        return timed

    def copies(self, nbytes):
        (name, run), = super().copies(nbytes).items()

        def timed():
            self.fake.now += nbytes / 1e10
            return run()

        return {name: timed}


def test_figures_are_the_hand_count_over_the_clock():
    backend = _TimedNumpy()
    fig = record.matmul_figure(backend, "fp32", (32, 64), repeat=3, min_seconds=1e-6)
    assert fig["per_size"] == pytest.approx({"32": 2.0, "64": 2.0}, rel=1e-9)
    assert fig["value"] == pytest.approx(2.0, rel=1e-9) and fig["unit"] == "TFLOP/s"
    nbytes = 4096
    (name, fn), = backend.copies(nbytes).items()
    copy = record.copy_figure(backend, name, fn, nbytes, repeat=3, min_seconds=1e-6)
    assert name == "memory" and copy["value"] == pytest.approx(20.0, rel=1e-9)


def test_numpy_products_are_products():
    out = record.NumpyBackend(seed=1).matmul(16, "fp64")()
    rng = np.random.default_rng(1)  # the same draws, multiplied independently
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 16))
    np.testing.assert_allclose(out, a @ b, rtol=1e-12, atol=1e-12)


def test_best_size_is_the_figure():
    backend = _TimedNumpy()
    base = backend.matmul

    def slower_for_small(n, precision):  # n = 32 runs at half the rate: 1 TFLOP/s
        run = base(n, precision)
        if n == 32:
            def slow():
                backend.fake.now += n**3 * 1e-12
                return run()
            return slow
        return run

    backend.matmul = slower_for_small
    fig = record.matmul_figure(backend, "fp64", (32, 64), repeat=3, min_seconds=1e-6)
    assert fig["per_size"]["32"] == pytest.approx(1.0) and fig["best_n"] == 64
    assert fig["value"] == pytest.approx(2.0)


@pytest.mark.parametrize("reported, sheet", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
    ("NVIDIA H100 SXM5 80GB", "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100"),
    ("Tesla V100-SXM2-32GB", "NVIDIA V100"),
    ("NVIDIA H200", "NVIDIA H200 SXM"),
    ("NVIDIA H200 NVL", None),
    ("Intel(R) Xeon(R) Processor", None),
])
def test_datasheet_names(reported, sheet):
    assert hardware.datasheet_name(reported) == sheet


def test_datasheet_peaks():
    h100 = "NVIDIA H100 SXM"
    assert hardware.datasheet_peak(h100, "matmul", "bf16").value == 989.4
    assert hardware.datasheet_peak(h100, "matmul", "fp8").value == 1978.9
    assert hardware.datasheet_peak(h100, "memory").value == 3350.0
    assert hardware.datasheet_peak(h100, "h2d_pinned").value == 63.0
    assert hardware.datasheet_peak("NVIDIA V100", "matmul", "bf16") is None
    assert hardware.datasheet_peak("NVIDIA A100", "d2h_pageable").value == 31.5
    h200 = "NVIDIA H200 SXM"  # the H100's chip: same dense peaks; HBM3e at 4.8 TB/s
    assert hardware.datasheet_peak(h200, "matmul", "bf16").value == 989.4
    assert hardware.datasheet_peak(h200, "memory").value == 4800.0
    assert hardware.MEMORY_GB[h200].value == 141.0


def test_a_cpu_record_round_trips(tmp_path):
    found = record.record(["numpy"], sizes=record.SIZES["quick"], repeat=2, today="2026-01-02")
    assert found["schema"] == record.SCHEMA and found["device"]["kind"] == "cpu"
    assert [(f["figure"], f["precision"]) for f in found["figures"]] == [
        ("matmul", "fp64"), ("matmul", "fp32"), ("memory", None)]
    assert all(f["value"] > 0 and f["datasheet_peak"] is None for f in found["figures"])
    path = record.write_record(found, tmp_path / "cpu.json")
    assert json.loads(path.read_text()) == found
    text = record.format_record(found)
    assert "measured 2026-01-02" in text and "fp32" in text and "GB/s" in text
    best = hardware.achievable(found["device"]["device"], "matmul", "fp32", folder=tmp_path)
    assert best.value == found["figures"][1]["value"] and "2026-01-02" in best.source


def test_achievable_takes_the_newest_record_and_its_best_backend(tmp_path):
    def rec(date, values):
        return {"schema": 1, "date": date,
                "device": {"device": "NVIDIA H100 80GB HBM3", "datasheet": "NVIDIA H100 SXM",
                           "kind": "gpu"},
                "figures": [{"figure": "matmul", "precision": "bf16", "backend": b,
                             "value": v, "method": f"{b} way"} for b, v in values]
                + [{"figure": "matmul", "precision": "fp8", "backend": "torch",
                    "error": "RuntimeError: no"}]}

    record.write_record(rec("2026-01-01", [("torch", 700.0)]), tmp_path / "a.json")
    record.write_record(rec("2026-02-01", [("torch", 650.0), ("cupy", 690.0)]),
                        tmp_path / "b.json")
    got = hardware.achievable("NVIDIA H100 SXM", "matmul", "bf16", folder=tmp_path)
    assert got.value == 690.0 and "2026-02-01" in got.source and "cupy way" in got.source
    assert hardware.achievable("NVIDIA H100 SXM", "matmul", "fp8", folder=tmp_path) is None
    assert hardware.achievable("NVIDIA A100", "matmul", "bf16", folder=tmp_path) is None


def test_committed_records_are_below_their_peaks():
    for rec in hardware.records():
        assert rec["schema"] == record.SCHEMA and rec["device"]["kind"] == "gpu"
        done = [f for f in rec["figures"] if "error" not in f]
        assert done, rec["device"]
        for f in done:
            assert f["value"] > 0
            if f["fraction_of_peak"] is not None:  # a data sheet's peak is not exceeded
                assert f["fraction_of_peak"] <= 1.0, f


def test_errors_are_clear():
    with pytest.raises(ValueError, match="backend"):
        record.make_backend("jax")
    with pytest.raises(ValueError, match="precision"):
        record.matmul_figure(record.NumpyBackend(), "bf16", (8,))
    with pytest.raises(ValueError, match="backends is empty"):
        record.record([])


def test_one_failing_figure_keeps_the_rest():
    backend = record.NumpyBackend()
    backend.precisions = lambda: ("fp32", "fp64")
    real = backend.matmul

    def broken(n, precision):
        if precision == "fp64":
            raise RuntimeError("no unit")
        return real(n, precision)

    backend.matmul = broken
    figs = record.measure(backend, record.SIZES["quick"], repeat=1)
    assert [f.get("error") for f in figs] == [None, "RuntimeError: no unit", None]


def test_torch_backend_on_the_cpu():
    torch = pytest.importorskip("torch")
    backend = record.TorchBackend("cpu")
    for precision in backend.precisions():
        fig = record.matmul_figure(backend, precision, (32,), repeat=1, min_seconds=1e-4)
        assert fig["value"] > 0
    a = torch.ones((4, 4))
    assert backend.copies(16)["memory"]().sum() == 16 and a.sum() == 16


def test_the_command_line_runs_without_tensorflow(tmp_path):
    out = tmp_path / "rec.json"
    code = ("import sys; from accel.__main__ import main; "
            f"rc = main(['hardware-record', '--quick', '--repeat', '1', '--out', {str(out)!r}]); "
            "print('tensorflow' in sys.modules, rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-2:] == ["False", "0"]
    assert json.loads(out.read_text())["device"]["kind"] == "cpu"
