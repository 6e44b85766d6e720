"""Hardware figures the cost models use, each with its source (vendor data sheets and standards).

These are *peak* figures: real training reaches a fraction of a peak FLOP/s (the cost models take
a utilisation) and real copies reach ~70-90% of a link's nominal bandwidth.

Peaks are dense: NVIDIA's and AMD's data sheets also print "with sparsity" figures (2:4
structured sparsity, twice the dense ones for TF32 and below), which are not used here.
Training in TensorFlow on V100 and newer runs its matmuls and convolutions on the tensor cores
when the dtype allows: TF32 for float32 on Ampere and newer (TensorFlow enables TF32 by default:
``tf.config.experimental.enable_tensor_float_32_execution``), FP16/BF16 under mixed precision.
The FP32 figure is what a float32 run sees on a V100, or with TF32 switched off. ``fp64`` is the
FP64 tensor-core (NVIDIA) or matrix-core (AMD) figure where there is one.

``BLOCK_FORMATS`` lists the block-scaled 8-, 6- and 4-bit formats (OCP MX, NVIDIA's NVFP4) with
their block and scale sizes; ``bits_per_element`` counts what one value costs with its scale.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from accel import checks

__all__ = ["Spec", "PEAK_TFLOPS", "LINKS", "peak_flops", "link_bandwidth", "PRECISIONS",
           "MEMORY_GB", "NODES", "DATASHEET_LINKS", "datasheet_name", "datasheet_peak",
           "RECORDS", "records", "achievable", "BlockFormat", "BLOCK_FORMATS",
           "bits_per_element"]


@dataclass(frozen=True)
class Spec:
    """A figure with the document it comes from."""

    value: float
    source: str


_V100 = "NVIDIA Tesla V100 data sheet (SXM2), 2017"
_A100 = "NVIDIA A100 Tensor Core GPU data sheet (SXM), 2020"
_H100 = "NVIDIA H100 Tensor Core GPU data sheet (SXM), 2022"
_H200 = "NVIDIA H200 Tensor Core GPU data sheet (SXM), 2024"
_K520 = "NVIDIA GRID K520 board specification: 2 GK104 GPUs, 4.9 TFLOP/s FP32 per board"
_B200 = ("NVIDIA HGX B200 specifications (8 GPUs), 2025: per GPU, the board's figures / 8, "
         "dense (the sheet prints TF32 to FP4 with sparsity: twice these)")
_DGX_B200 = "NVIDIA DGX B200 data sheet, 2025: 1,440 GB of HBM3e, 64 TB/s, over 8 GPUs"
_DGX_B300 = ("NVIDIA DGX B300 data sheet, 2025: 2.3 TB of HBM3e over 8 GPUs; 288 GB per GPU "
             "(NVIDIA technical blog, 'Inside NVIDIA Blackwell Ultra', 2025)")
_MI300X_SHEET = "AMD Instinct MI300X data sheet, 2023"
_MI325X_SHEET = "AMD Instinct MI325X data sheet, 2024"
_MI355X_SHEET = "AMD Instinct MI355X data sheet, 2025"
_MI300X = _MI300X_SHEET + " (dense; 'with sparsity' is twice)"
_MI325X = _MI325X_SHEET + " (the MI300X's CDNA 3 chip: the same dense peaks)"
_MI355X = (_MI355X_SHEET + " (dense; printed rounded, 2.5 / 5.0 / 10.1 PFLOP/s: 256 CUs x "
           "2.4 GHz x 4,096 / 8,192 / 16,384 FLOPs per CU per clock, CDNA 4 white paper)")

# "fp8": E4M3 / E5M2 (per-tensor scaled, or block-scaled MXFP8 where the GPU reads MX scales);
# "fp4": FP4 (E2M1) values with a scale per block (MXFP4, NVFP4: BLOCK_FORMATS)
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4")

# device -> precision -> dense peak in TFLOP/s (a precision is absent where there is no unit)
PEAK_TFLOPS: dict[str, dict[str, Spec]] = {
    "NVIDIA K520 (2013, per GPU)": {"fp32": Spec(2.45, _K520)},
    "NVIDIA V100": {"fp32": Spec(15.7, _V100), "fp16": Spec(125.0, _V100)},
    "NVIDIA A100": {"fp64": Spec(19.5, _A100 + " (FP64 Tensor Core)"),
                    "fp32": Spec(19.5, _A100), "tf32": Spec(156.0, _A100),
                    "bf16": Spec(312.0, _A100), "fp16": Spec(312.0, _A100)},
    "NVIDIA H100 SXM": {"fp64": Spec(67.0, _H100 + " (FP64 Tensor Core)"),
                        "fp32": Spec(67.0, _H100), "tf32": Spec(494.7, _H100),
                        "bf16": Spec(989.4, _H100), "fp16": Spec(989.4, _H100),
                        "fp8": Spec(1978.9, _H100 + " (FP8 Tensor Core, E4M3/E5M2)")},
    # the H100's GH100 chip with more and faster memory: the same dense peaks (the sheet
    # prints the sparse ones, twice these, for TF32 and below)
    "NVIDIA H200 SXM": {"fp64": Spec(67.0, _H200 + " (FP64 Tensor Core)"),
                        "fp32": Spec(67.0, _H200), "tf32": Spec(494.7, _H200),
                        "bf16": Spec(989.4, _H200), "fp16": Spec(989.4, _H200),
                        "fp8": Spec(1978.9, _H200 + " (FP8 Tensor Core)")},
    # Blackwell (HGX B200, 1,000 W per GPU); FP4 is NVFP4 or MXFP4, at twice the FP8 rate
    "NVIDIA B200": {"fp64": Spec(37.0, _B200 + " (FP64 / FP64 Tensor Core: 296 TFLOP/s)"),
                    "fp32": Spec(75.0, _B200 + " (FP32: 600 TFLOP/s)"),
                    "tf32": Spec(1125.0, _B200 + " (TF32 Tensor Core: 18 PFLOP/s sparse)"),
                    "bf16": Spec(2250.0, _B200 + " (FP16/BF16 Tensor Core: 36 PFLOP/s sparse)"),
                    "fp16": Spec(2250.0, _B200 + " (FP16/BF16 Tensor Core: 36 PFLOP/s sparse)"),
                    "fp8": Spec(4500.0, _B200 + " (FP8/FP6 Tensor Core: 72 PFLOP/s sparse)"),
                    "fp4": Spec(9000.0, _B200 + " (FP4 Tensor Core: 144 PFLOP/s sparse)")},
    "AMD MI300X": {"fp64": Spec(163.4, _MI300X + " (FP64 matrix)"),
                   "fp32": Spec(163.4, _MI300X + " (FP32 vector)"),
                   "tf32": Spec(653.7, _MI300X), "bf16": Spec(1307.4, _MI300X),
                   "fp16": Spec(1307.4, _MI300X),
                   "fp8": Spec(2614.9, _MI300X + " (FP8: E4M3 / E5M2 in their FNUZ variants, "
                                                 "ROCm's data types and precision support page)")},
    "AMD MI325X": {"fp64": Spec(163.4, _MI325X + " (FP64 matrix)"),
                   "fp32": Spec(163.4, _MI325X + " (FP32 vector)"),
                   "tf32": Spec(653.7, _MI325X), "bf16": Spec(1307.4, _MI325X),
                   "fp16": Spec(1307.4, _MI325X), "fp8": Spec(2614.9, _MI325X + " (FNUZ FP8)")},
    # CDNA 4 has no TF32 matrix unit: hipBLASLt emulates TF32 with BF16 products on it
    # (ROCm/hipBLASLt pull request 1806, "TF32 Emulation for gfx950")
    "AMD MI355X": {"fp64": Spec(78.6, _MI355X + " (FP64 matrix)"),
                   "fp32": Spec(157.3, _MI355X + " (FP32 vector)"),
                   "bf16": Spec(2516.6, _MI355X), "fp16": Spec(2516.6, _MI355X),
                   "fp8": Spec(5033.2, _MI355X),
                   "fp4": Spec(10066.3, _MI355X + " (MXFP4; MXFP6 at the same rate)")},
}

_PCIE = "PCI-SIG base specifications: 8 / 16 / 32 GT/s per lane, 128b/130b encoding"
# one direction, GB/s (10^9 bytes per second)
LINKS: dict[str, Spec] = {
    "PCIe 3.0 x16": Spec(15.75, _PCIE),
    "PCIe 4.0 x16": Spec(31.5, _PCIE),
    "PCIe 5.0 x16": Spec(63.0, _PCIE),
    "NVLink 2 (V100, per GPU)": Spec(150.0, _V100 + ": 300 GB/s total, both directions"),
    "NVLink 3 (A100, per GPU)": Spec(300.0, _A100 + ": 600 GB/s total, both directions"),
    "NVLink 4 (H100, per GPU)": Spec(450.0, _H100 + ": 900 GB/s total, both directions"),
    "HBM2 (V100 device memory)": Spec(900.0, _V100),
    "HBM2e (A100 80GB device memory)": Spec(2039.0, _A100),
    "HBM3 (H100 SXM device memory)": Spec(3350.0, _H100),
    "HBM3e (H200 SXM device memory)": Spec(4800.0, _H200 + ": 4.8 TB/s"),
    "HBM3e (B200 device memory)": Spec(8000.0, _DGX_B200 + ": 8 TB/s per GPU"),
    "HBM3 (MI300X device memory)": Spec(5300.0, _MI300X_SHEET + ": 5.3 TB/s"),
    "HBM3E (MI325X device memory)": Spec(6000.0, _MI325X_SHEET + ": 6 TB/s"),
    "HBM3E (MI355X device memory)": Spec(8000.0, _MI355X_SHEET + ": 8 TB/s"),
    "10 Gb Ethernet": Spec(1.25, "IEEE 802.3ae: 10 Gb/s"),
    "100 Gb Ethernet": Spec(12.5, "IEEE 802.3ba: 100 Gb/s"),
    "InfiniBand HDR (200 Gb/s)": Spec(25.0, "InfiniBand Trade Association roadmap: HDR 200 Gb/s"),
    "InfiniBand NDR (400 Gb/s)": Spec(50.0, "InfiniBand Trade Association roadmap: NDR 400 Gb/s"),
}


# device -> memory per GPU in GB (10^9 bytes)
MEMORY_GB: dict[str, Spec] = {
    "NVIDIA V100": Spec(32.0, _V100 + " (32 GB model)"),
    "NVIDIA A100": Spec(80.0, _A100 + " (80 GB model)"),
    "NVIDIA H100 SXM": Spec(80.0, _H100),
    "NVIDIA H200 SXM": Spec(141.0, _H200),
    "NVIDIA B200": Spec(180.0, _DGX_B200),
    "NVIDIA B300": Spec(288.0, _DGX_B300),
    "AMD MI300X": Spec(192.0, _MI300X_SHEET + ": 192 GB HBM3"),
    "AMD MI325X": Spec(256.0, _MI325X_SHEET + ": 256 GB HBM3E"),
    "AMD MI355X": Spec(288.0, _MI355X_SHEET + ": 288 GB HBM3E"),
}

_DGX_A100 = ("NVIDIA DGX A100 data sheet, 2020: 8 A100 GPUs joined by NVSwitch, 8 single-port "
             "ConnectX-6 200 Gb/s HDR InfiniBand adapters for the compute network")
# node -> (GPUs per node, one-direction bandwidth per GPU out of the node in GB/s)
NODES: dict[str, tuple[int, Spec]] = {
    "DGX A100": (8, Spec(25.0, _DGX_A100 + ": one 200 Gb/s (25 GB/s) adapter per GPU")),
}



@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled number format: ``block`` values of ``element_bits`` each share one scale of
    ``scale_bits``."""

    element: str
    element_bits: int
    block: int
    scale: str
    scale_bits: int
    source: str


_OCP_MX = ("OCP Microscaling Formats (MX) Specification v1.0, 2023: blocks of 32 values sharing "
           "one E8M0 scale (a power of two)")
_NVFP4 = ("NVIDIA NVFP4 (Blackwell): blocks of 16 FP4 values, each with an E4M3 scale (cuBLASLt "
          "scale mode CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3), plus one FP32 scale per tensor")
_DEEPSEEK = ("DeepSeek-V3 technical report (arXiv:2412.19437): activations in FP8 with one FP32 "
             "scale per 1x128 tile, weights per 128x128 block (cuBLASLt scale modes VEC128_32F, "
             "BLK128x128_32F)")
# name -> format; what the tensor cores of Blackwell (compute capability 10) and the matrix
# cores of CDNA 4 read with the scales applied inside the matmul (MX formats on both)
BLOCK_FORMATS: dict[str, BlockFormat] = {
    "MXFP8": BlockFormat("E4M3 or E5M2", 8, 32, "E8M0", 8, _OCP_MX),
    "MXFP6": BlockFormat("E2M3 or E3M2", 6, 32, "E8M0", 8, _OCP_MX),
    "MXFP4": BlockFormat("E2M1", 4, 32, "E8M0", 8, _OCP_MX),
    "NVFP4": BlockFormat("E2M1", 4, 16, "E4M3", 8, _NVFP4),
    "FP8, 1x128 tiles": BlockFormat("E4M3", 8, 128, "FP32", 32, _DEEPSEEK),
}


def bits_per_element(name: str) -> float:
    """Bits one value of the block-scaled format ``name`` (a key of ``BLOCK_FORMATS``) costs,
    its share of the block's scale included (NVFP4's one FP32 scale per tensor left out)."""
    checks.one_of("name", name, BLOCK_FORMATS)
    fmt = BLOCK_FORMATS[name]
    return fmt.element_bits + fmt.scale_bits / fmt.block


def peak_flops(device: str, precision: str = "fp32") -> float:
    """Dense peak FLOP/s of ``device`` (a key of ``PEAK_TFLOPS``) at ``precision``."""
    checks.one_of("device", device, PEAK_TFLOPS)
    have = PEAK_TFLOPS[device]
    if precision not in have:
        raise ValueError(f"{device} has no {precision!r} peak (no such unit); it has "
                         f"{sorted(have)}; precisions are {PRECISIONS}")
    return have[precision].value * 1e12


def link_bandwidth(link: str) -> float:
    """Nominal one-direction bandwidth of ``link`` (a key of ``LINKS``) in bytes per second."""
    checks.one_of("link", link, LINKS)
    return LINKS[link].value * 1e9


# what a measured record's figures are held against, per data sheet (accel.costmodel.record):
# device memory for "memory", the host link for the host <-> device copies
DATASHEET_LINKS: dict[str, dict[str, str]] = {
    "NVIDIA V100": {"memory": "HBM2 (V100 device memory)", "host": "PCIe 3.0 x16"},
    "NVIDIA A100": {"memory": "HBM2e (A100 80GB device memory)", "host": "PCIe 4.0 x16"},
    "NVIDIA H100 SXM": {"memory": "HBM3 (H100 SXM device memory)", "host": "PCIe 5.0 x16"},
    "NVIDIA H200 SXM": {"memory": "HBM3e (H200 SXM device memory)", "host": "PCIe 5.0 x16"},
    "NVIDIA B200": {"memory": "HBM3e (B200 device memory)"},
    "AMD MI300X": {"memory": "HBM3 (MI300X device memory)", "host": "PCIe 5.0 x16"},
    "AMD MI325X": {"memory": "HBM3E (MI325X device memory)", "host": "PCIe 5.0 x16"},
    "AMD MI355X": {"memory": "HBM3E (MI355X device memory)", "host": "PCIe 5.0 x16"},
}


def datasheet_name(reported: str) -> str | None:
    """The key of ``PEAK_TFLOPS`` whose data sheet describes the device a driver reports as
    ``reported`` (e.g. ``"NVIDIA H100 80GB HBM3"``, the SXM board; ``"NVIDIA H200"``;
    ``"AMD Instinct MI300X"``), or ``None`` where this module has no data sheet for it (an H100
    PCIe or NVL, an H200 NVL, a GB200's GPU, a CPU)."""
    name = reported.upper()
    for marker in ("MI300X", "MI325X", "MI355X"):
        if marker in name:
            return f"AMD {marker}"
    if "B200" in name:
        return None if "GB200" in name else "NVIDIA B200"
    if "H200" in name:
        return None if "NVL" in name else "NVIDIA H200 SXM"
    if "H100" in name:
        return "NVIDIA H100 SXM" if ("HBM3" in name or "SXM" in name) and "NVL" not in name \
            else None
    for key, marker in (("NVIDIA A100", "A100"), ("NVIDIA V100", "V100")):
        if marker in name:
            return key
    return None


def datasheet_peak(sheet: str, figure: str, precision: str | None = None) -> Spec | None:
    """The data sheet's peak for a measured figure: ``"matmul"`` at ``precision`` (TFLOP/s),
    ``"memory"`` (device memory, GB/s) or a host copy (``"h2d_pinned"``, ...: the host link,
    GB/s one direction); ``None`` where the sheet has none."""
    if figure == "matmul":
        return PEAK_TFLOPS.get(sheet, {}).get(precision)
    links = DATASHEET_LINKS.get(sheet, {})
    link = links.get("memory" if figure == "memory" else "host")
    return LINKS[link] if link else None


RECORDS = Path(__file__).parent / "records"


def records(folder: str | Path = RECORDS) -> list[dict]:
    """The measured records (``python -m accel hardware-record``'s JSON files) in ``folder``,
    oldest first."""
    found = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
    return sorted(found, key=lambda r: r["date"])


def achievable(device: str, figure: str = "matmul", precision: str | None = None,
               folder: str | Path = RECORDS) -> Spec | None:
    """The best figure measured on ``device`` (a data-sheet key such as ``"NVIDIA H100 SXM"``,
    or the name the driver reports) in the newest record of it, with where and when it was
    measured as its source; ``None`` where no record has it (then cite a published figure)."""
    for rec in reversed(records(folder)):
        if device not in (rec["device"]["device"], rec["device"].get("datasheet")):
            continue
        hits = [f for f in rec["figures"] if "error" not in f and f["figure"] == figure
                and f.get("precision") == precision]
        if hits:
            best = max(hits, key=lambda f: f["value"])
            return Spec(best["value"], f"measured on {rec['device']['device']} on "
                                       f"{rec['date']} ({best['method']})")
    return None
