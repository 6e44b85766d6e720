"""accel.costmodel.hardware's newer entries against the literal figures of their data sheets
(NVIDIA HGX / DGX B200, AMD Instinct MI300X / MI325X / MI355X), and the block-scaled formats
against a hand count and ml_dtypes' own bit widths."""

import ml_dtypes
import pytest

from accel.costmodel import hardware

# the HGX B200 sheet prints an 8-GPU board's figures, TF32 to FP4 "with sparsity"
HGX_B200_BOARD = {"fp64": 296.0, "fp32": 600.0, "tf32": 18_000.0, "bf16": 36_000.0,
                  "fp16": 36_000.0, "fp8": 72_000.0, "fp4": 144_000.0}
SPARSE = {"tf32", "bf16", "fp16", "fp8", "fp4"}
# the AMD sheets print dense figures in TFLOP/s (MI355X: PFLOP/s rounded to one decimal)
MI300X = {"fp64": 163.4, "fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4,
          "fp8": 2614.9}
MI355X_PRINTED_PFLOPS = {"bf16": 2.5, "fp16": 2.5, "fp8": 5.0, "fp4": 10.1}


def test_b200_is_the_hgx_board_per_gpu_and_dense():
    peaks = hardware.PEAK_TFLOPS["NVIDIA B200"]
    assert set(peaks) == set(HGX_B200_BOARD)
    for precision, board in HGX_B200_BOARD.items():
        per_gpu = board / 8 / (2 if precision in SPARSE else 1)
        assert peaks[precision].value == pytest.approx(per_gpu), precision
    assert hardware.peak_flops("NVIDIA B200", "fp4") == 9000e12
    # DGX B200: 1,440 GB and 64 TB/s of HBM3e over 8 GPUs
    assert hardware.MEMORY_GB["NVIDIA B200"].value * 8 == 1440.0
    assert hardware.link_bandwidth("HBM3e (B200 device memory)") * 8 == 64e12


def test_amd_entries_are_their_data_sheets():
    for name in ("AMD MI300X", "AMD MI325X"):  # one CDNA 3 chip: the same peaks
        assert {p: s.value for p, s in hardware.PEAK_TFLOPS[name].items()} == MI300X
    # 304 CUs at 2.1 GHz x FLOPs per CU per clock (FP32 256, TF32 1,024, FP16 2,048, FP8 4,096)
    for precision, per_clock in (("fp32", 256), ("tf32", 1024), ("fp16", 2048), ("fp8", 4096)):
        assert MI300X[precision] == pytest.approx(304 * 2.1e9 * per_clock / 1e12, abs=0.05)
    assert [hardware.MEMORY_GB[f"AMD {m}"].value for m in ("MI300X", "MI325X", "MI355X")] == [
        192.0, 256.0, 288.0]
    assert [hardware.link_bandwidth(link) / 1e12 for link in (
        "HBM3 (MI300X device memory)", "HBM3E (MI325X device memory)",
        "HBM3E (MI355X device memory)")] == [5.3, 6.0, 8.0]
    mi355x = hardware.PEAK_TFLOPS["AMD MI355X"]
    for precision, printed in MI355X_PRINTED_PFLOPS.items():
        assert round(mi355x[precision].value / 1000, 1) == printed, precision
    # CU count x clock x FLOPs per CU per clock (256 CUs at 2.4 GHz; FP8: 8,192)
    assert mi355x["fp8"].value == pytest.approx(256 * 2.4e9 * 8192 / 1e12, abs=0.05)
    assert (mi355x["fp64"].value, mi355x["fp32"].value) == (78.6, 157.3)


def test_b300_memory_is_its_dgx_sheet():
    # DGX B300: 2.3 TB of HBM3e over 8 GPUs, 288 GB each (as the MI355X)
    b300 = hardware.MEMORY_GB["NVIDIA B300"]
    assert round(b300.value * 8 / 1000, 1) == 2.3
    assert b300.value == hardware.MEMORY_GB["AMD MI355X"].value == 288.0
    assert "DGX B300 data sheet" in b300.source


def test_mi355x_has_no_tf32_unit():
    with pytest.raises(ValueError, match="no 'tf32' peak"):
        hardware.peak_flops("AMD MI355X", "tf32")


def test_every_new_figure_names_its_sheet():
    for name in ("NVIDIA B200", "AMD MI300X", "AMD MI325X", "AMD MI355X"):
        assert all("data sheet" in s.source or "specifications" in s.source
                   for s in hardware.PEAK_TFLOPS[name].values())
        assert hardware.MEMORY_GB[name].source


@pytest.mark.parametrize(("reported", "sheet"), [
    ("NVIDIA B200", "NVIDIA B200"),
    ("NVIDIA GB200", None),  # the superchip's GPU runs at other clocks and power
    ("AMD Instinct MI300X", "AMD MI300X"),
    ("AMD Instinct MI300X VF", "AMD MI300X"),
    ("AMD Instinct MI325X", "AMD MI325X"),
    ("AMD Instinct MI355X", "AMD MI355X"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),  # the older names as before
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100"),
])
def test_datasheet_names_of_newer_gpus(reported, sheet):
    assert hardware.datasheet_name(reported) == sheet


def test_datasheet_peaks_of_newer_gpus():
    assert hardware.datasheet_peak("NVIDIA B200", "matmul", "fp8").value == 4500.0
    assert hardware.datasheet_peak("NVIDIA B200", "memory").value == 8000.0
    assert hardware.datasheet_peak("NVIDIA B200", "h2d_pinned") is None  # no host link listed
    assert hardware.datasheet_peak("AMD MI300X", "h2d_pinned").value == 63.0
    assert hardware.datasheet_peak("AMD MI355X", "matmul", "tf32") is None


def test_bits_per_element_by_hand():
    # MX: 32 values share one 8-bit E8M0 scale; NVFP4: 16 FP4 values share an 8-bit E4M3 scale
    assert hardware.bits_per_element("MXFP8") == 8 + 8 / 32 == 8.25
    assert hardware.bits_per_element("MXFP6") == 6.25
    assert hardware.bits_per_element("MXFP4") == 4.25
    assert hardware.bits_per_element("NVFP4") == 4.5
    # DeepSeek-V3's activations: a float32 scale per 128 values costs what MXFP8's does
    assert hardware.bits_per_element("FP8, 1x128 tiles") == 8.25


def test_block_formats_match_ml_dtypes_widths():
    widths = {"E4M3": ml_dtypes.float8_e4m3fn, "E5M2": ml_dtypes.float8_e5m2,
              "E2M3": ml_dtypes.float6_e2m3fn, "E3M2": ml_dtypes.float6_e3m2fn,
              "E2M1": ml_dtypes.float4_e2m1fn, "E8M0": ml_dtypes.float8_e8m0fnu}
    for fmt in hardware.BLOCK_FORMATS.values():
        for element in fmt.element.split(" or "):
            assert ml_dtypes.finfo(widths[element]).bits == fmt.element_bits, fmt
        if fmt.scale in widths:
            assert ml_dtypes.finfo(widths[fmt.scale]).bits == fmt.scale_bits, fmt
    # an E8M0 scale is a power of two: no mantissa bits
    assert ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu).nmant == 0


@pytest.mark.parametrize("name", ["MXFP2", "mxfp8", ""])
def test_bits_per_element_refuses_unknown_formats(name):
    with pytest.raises(ValueError, match="name must be one of"):
        hardware.bits_per_element(name)
