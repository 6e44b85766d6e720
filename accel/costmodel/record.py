"""A measured hardware record: what a device *reaches*, beside the data sheet's peak.

The cost models (``accel.costmodel.hardware``) start from vendor peaks. A peak is what the
arithmetic units could do if every cycle were busy; what a program reaches is lower, and by how
much depends on the precision, the problem size and the library. This module measures it:

* ``matmul``: achievable dense matrix-product throughput per precision (``fp64``, ``fp32``,
  ``tf32``, ``bf16``, ``fp16``, ``fp8``, where the backend has the unit), in TFLOP/s counting
  ``2 n^3`` FLOPs per ``n x n`` product, the best median over a few sizes;
* ``memory``: device memory bandwidth, from a device-to-device copy, counting the bytes read
  *and* written (the convention of the data sheets' HBM figures and of NVIDIA's
  ``bandwidthTest``);
* ``h2d`` / ``d2h``: host-to-device and device-to-host copy bandwidth, from pinned (page-locked)
  and from pageable host buffers.

Backends (``BACKENDS``): ``numpy`` (the CPU, always available), ``cupy`` and ``torch`` (a CUDA
GPU, each used only where it is installed; neither is a dependency of this package). This
module imports no TensorFlow, so it runs on machines that have a GPU and no TensorFlow.
``record(backends)`` returns one JSON-ready dictionary: the device, driver and library versions,
the date, and every figure with its method, its per-size medians and, where the data sheet is
known (``hardware.datasheet_name``), the peak and the fraction of it reached.
``python -m accel hardware-record`` writes it; committed records live in
``accel/costmodel/records/`` and ``hardware.achievable`` reads them.

Timing: on a GPU, CUDA events around ``inner`` back-to-back operations (so the launch overhead
of one call is amortised), after warm-up calls; on the CPU, ``time.perf_counter`` the same way.
Each figure is the median of ``repeat`` such measurements.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from accel import checks
from accel.costmodel import hardware

__all__ = ["SCHEMA", "BACKENDS", "MATMUL_PRECISIONS", "Backend", "NumpyBackend",
           "CupyBackend", "TorchBackend", "available_backends", "make_backend", "matmul_figure",
           "copy_figure", "measure", "record", "format_record", "write_record", "SIZES"]

SCHEMA = 1
BACKENDS = ("numpy", "cupy", "torch")
MATMUL_PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
# per kind of device: matrix sizes n for the products, and bytes for the copies
SIZES = {
    "cpu": {"matmul": (512, 1024, 2048), "copy": 256 * 2**20},
    "gpu": {"matmul": (2048, 4096, 8192, 16384), "copy": 1024 * 2**20},
    "quick": {"matmul": (64, 128), "copy": 2**20},
}


class Backend:
    """What the measurements need from an array library. ``kind`` is ``"cpu"`` or ``"gpu"``;
    ``timed(fn, inner)`` runs ``fn()`` ``inner`` times and returns the seconds they took."""

    name = ""
    kind = "cpu"

    def precisions(self) -> tuple[str, ...]:
        raise NotImplementedError

    def matmul(self, n: int, precision: str) -> Callable[[], object]:
        """A zero-argument function that computes one ``n x n`` product at ``precision``."""
        raise NotImplementedError

    def timed(self, fn: Callable[[], object], inner: int) -> float:
        raise NotImplementedError

    def copies(self, nbytes: int) -> dict[str, Callable[[], object]]:
        """Zero-argument functions, by figure name, each copying ``nbytes`` once."""
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError


class NumpyBackend(Backend):
    """The CPU through NumPy's BLAS. ``clock``: seconds now (``time.perf_counter``; a test
    injects its own)."""

    name = "numpy"
    kind = "cpu"

    def __init__(self, clock: Callable[[], float] = time.perf_counter, seed: int = 0):
        import numpy as np

        self.np = np
        self.clock = clock
        self.rng = np.random.default_rng(seed)

    def precisions(self):
        return ("fp64", "fp32")  # NumPy has no float16 BLAS (its float16 matmul is a loop)

    def matmul(self, n, precision):
        dtype = {"fp64": self.np.float64, "fp32": self.np.float32}[precision]
        a = self.rng.standard_normal((n, n)).astype(dtype)
        b = self.rng.standard_normal((n, n)).astype(dtype)
        out = self.np.empty((n, n), dtype)
        return lambda: self.np.matmul(a, b, out=out)

    def timed(self, fn, inner):
        start = self.clock()
        for _ in range(inner):
            fn()
        return self.clock() - start

    def copies(self, nbytes):
        src = self.np.ones(nbytes, self.np.uint8)
        dst = self.np.empty_like(src)
        return {"memory": lambda: self.np.copyto(dst, src)}

    def describe(self):
        return {"device": _cpu_name(), "kind": "cpu", "cores": os.cpu_count(),
                "libraries": {"numpy": self.np.__version__}}


class CupyBackend(Backend):
    """A CUDA GPU through CuPy (cuBLAS for the products). CuPy has no bfloat16 or float8 type
    and switches TF32 only through an environment variable read at its import, so it measures
    fp64, fp32 and fp16 (the ``torch`` backend measures the others)."""

    name = "cupy"
    kind = "gpu"

    def __init__(self, seed: int = 0):
        import cupy
        import numpy as np

        self.cp, self.np = cupy, np
        self.rng = cupy.random.default_rng(seed)

    def precisions(self):
        return ("fp64", "fp32", "fp16")

    def matmul(self, n, precision):
        dtype = {"fp64": self.cp.float64, "fp32": self.cp.float32,
                 "fp16": self.cp.float16}[precision]
        a = self.rng.standard_normal((n, n), dtype=self.cp.float32).astype(dtype)
        b = self.rng.standard_normal((n, n), dtype=self.cp.float32).astype(dtype)
        out = self.cp.empty((n, n), dtype)
        return lambda: self.cp.matmul(a, b, out=out)

    def timed(self, fn, inner):
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) / 1e3

    def copies(self, nbytes):
        cp, np = self.cp, self.np
        src = cp.ones(nbytes, cp.uint8)
        dst = cp.empty_like(src)
        pinned_mem = cp.cuda.alloc_pinned_memory(nbytes)
        pinned = np.frombuffer(pinned_mem, np.uint8, nbytes)
        pinned[:] = 1
        pageable = np.ones(nbytes, np.uint8)
        return {"memory": lambda: cp.copyto(dst, src),
                "h2d_pinned": lambda: dst.set(pinned),
                "h2d_pageable": lambda: dst.set(pageable),
                "d2h_pinned": lambda: src.get(out=pinned),
                "d2h_pageable": lambda: src.get(out=pageable)}

    def describe(self):
        rt = self.cp.cuda.runtime
        props = rt.getDeviceProperties(0)
        name = props["name"]
        return {"device": name.decode() if isinstance(name, bytes) else str(name), "kind": "gpu",
                "memory_bytes": int(props["totalGlobalMem"]),
                "multiprocessors": int(props["multiProcessorCount"]),
                "compute_capability": f"{props['major']}.{props['minor']}",
                "cuda_driver": rt.driverGetVersion(), "cuda_runtime": rt.runtimeGetVersion(),
                "libraries": {"cupy": self.cp.__version__, "numpy": self.np.__version__}}


class TorchBackend(Backend):
    """A CUDA GPU through PyTorch: every precision the GPU has (``tf32`` by
    ``torch.set_float32_matmul_precision("high")``, ``fp32`` with ``"highest"``; ``fp8`` as
    e4m3 operands through ``torch._scaled_mm`` with bfloat16 output, Hopper and newer).
    ``device="cpu"`` runs the same code on the CPU (how the tests exercise it)."""

    name = "torch"

    def __init__(self, device: str = "cuda", seed: int = 0):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.kind = "gpu" if self.device.type == "cuda" else "cpu"
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def precisions(self):
        if self.kind == "cpu":
            return ("fp64", "fp32", "bf16", "fp8")
        major, _ = self.torch.cuda.get_device_capability(self.device)
        have = ["fp64", "fp32"]
        if major >= 8:
            have += ["tf32", "bf16"]
        have.append("fp16")
        if major >= 9 and hasattr(self.torch, "float8_e4m3fn"):
            have.append("fp8")
        return tuple(have)

    def _randn(self, n, dtype):
        return self.torch.randn((n, n), generator=self.gen, device=self.device, dtype=dtype)

    def matmul(self, n, precision):
        t = self.torch
        if precision == "fp8":
            a = self._randn(n, t.float32).to(t.float8_e4m3fn)
            b = self._randn(n, t.float32).to(t.float8_e4m3fn).t()  # column-major, as required
            one = t.tensor(1.0, device=self.device)
            return lambda: t._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=t.bfloat16)
        dtype = {"fp64": t.float64, "fp32": t.float32, "tf32": t.float32, "bf16": t.bfloat16,
                 "fp16": t.float16}[precision]
        a, b = self._randn(n, dtype), self._randn(n, dtype)
        out = t.empty((n, n), device=self.device, dtype=dtype)
        mode = "high" if precision == "tf32" else "highest"

        def run():
            t.set_float32_matmul_precision(mode)
            return t.matmul(a, b, out=out)

        return run

    def timed(self, fn, inner):
        t = self.torch
        if self.kind == "cpu":
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return time.perf_counter() - start
        start, end = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def copies(self, nbytes):
        t = self.torch
        src = t.ones(nbytes, dtype=t.uint8, device=self.device)
        dst = t.empty_like(src)
        found = {"memory": lambda: dst.copy_(src)}
        if self.kind == "gpu":
            pinned = t.ones(nbytes, dtype=t.uint8, pin_memory=True)
            pageable = t.ones(nbytes, dtype=t.uint8)
            found.update({"h2d_pinned": lambda: dst.copy_(pinned, non_blocking=True),
                          "h2d_pageable": lambda: dst.copy_(pageable),
                          "d2h_pinned": lambda: pinned.copy_(src, non_blocking=True),
                          "d2h_pageable": lambda: pageable.copy_(src)})
        return found

    def describe(self):
        t = self.torch
        found = {"kind": self.kind, "libraries": {"torch": t.__version__}}
        if self.kind == "cpu":
            found["device"] = _cpu_name()
            return found
        props = t.cuda.get_device_properties(self.device)
        found.update({"device": props.name, "memory_bytes": int(props.total_memory),
                      "multiprocessors": int(props.multi_processor_count),
                      "compute_capability": f"{props.major}.{props.minor}",
                      "cuda_runtime": t.version.cuda})
        return found


_MAKERS = {"numpy": NumpyBackend, "cupy": CupyBackend, "torch": TorchBackend}


def available_backends() -> list[str]:
    """The backends usable here: ``numpy`` always; ``cupy`` and ``torch`` where they import
    and see a CUDA GPU."""
    found = ["numpy"]
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            found.append("cupy")
    except Exception:  # not installed, or no driver / no GPU
        pass
    try:
        import torch

        if torch.cuda.is_available():
            found.append("torch")
    except Exception:
        pass
    return found


def make_backend(name: str) -> Backend:
    """A backend by name (one of ``BACKENDS``)."""
    checks.one_of("backend", name, BACKENDS)
    return _MAKERS[name]()


def _per_call(backend: Backend, fn: Callable[[], object], repeat: int, warmup: int,
              min_seconds: float) -> list[float]:
    """``repeat`` measurements of one call's seconds, each over enough back-to-back calls to
    last about ``min_seconds`` (found from the warm-up)."""
    for _ in range(warmup):
        backend.timed(fn, 1)
    one = max(backend.timed(fn, 1), 1e-9)
    inner = max(1, min(1000, int(min_seconds / one)))
    return [backend.timed(fn, inner) / inner for _ in range(repeat)]


def matmul_figure(backend: Backend, precision: str, sizes: Sequence[int], repeat: int = 5,
                  warmup: int = 2, min_seconds: float = 0.05) -> dict:
    """Achievable matmul TFLOP/s at ``precision``: per size the median of ``repeat``
    measurements of ``2 n^3`` FLOPs over one product's seconds; the figure is the best size's."""
    checks.one_of("precision", precision, backend.precisions())
    per_size = {}
    for n in sizes:
        checks.positive_int("n", n)
        seconds = statistics.median(_per_call(backend, backend.matmul(n, precision), repeat,
                                              warmup, min_seconds))
        per_size[str(n)] = 2 * n**3 / seconds / 1e12
    best = max(per_size, key=per_size.get)
    return {"figure": "matmul", "precision": precision, "backend": backend.name,
            "value": per_size[best], "unit": "TFLOP/s", "per_size": per_size, "best_n": int(best),
            "method": f"{backend.name} matmul of random n x n operands, 2 n^3 FLOPs per product; "
                      f"median of {repeat} timings per n after {warmup} warm-up calls; the best "
                      "n"}


_COPY_METHOD = {
    "memory": "device-to-device copy; bytes read + bytes written per second",
    "h2d_pinned": "host-to-device copy from a pinned (page-locked) buffer",
    "h2d_pageable": "host-to-device copy from a pageable buffer",
    "d2h_pinned": "device-to-host copy into a pinned (page-locked) buffer",
    "d2h_pageable": "device-to-host copy into a pageable buffer",
}


def copy_figure(backend: Backend, name: str, fn: Callable[[], object], nbytes: int,
                repeat: int = 5, warmup: int = 2, min_seconds: float = 0.05) -> dict:
    """One copy's bandwidth in GB/s (10^9 bytes per second): ``nbytes`` per copy, twice that
    for ``memory`` (read and written), over the median of ``repeat`` timings."""
    checks.one_of("copy", name, _COPY_METHOD)
    seconds = statistics.median(_per_call(backend, fn, repeat, warmup, min_seconds))
    moved = 2 * nbytes if name == "memory" else nbytes
    return {"figure": name, "precision": None, "backend": backend.name,
            "value": moved / seconds / 1e9, "unit": "GB/s", "bytes": nbytes,
            "method": f"{backend.name}: {_COPY_METHOD[name]}, {nbytes} B a copy; median of "
                      f"{repeat} timings after {warmup} warm-up copies"}


def _with_peak(figure: dict, sheet: str | None) -> dict:
    """``figure`` with the data sheet's peak and the fraction reached (``None`` where unknown)."""
    peak = hardware.datasheet_peak(sheet, figure["figure"], figure["precision"]) if sheet else None
    figure["datasheet"] = sheet
    figure["datasheet_peak"] = None if peak is None else peak.value
    figure["datasheet_source"] = None if peak is None else peak.source
    figure["fraction_of_peak"] = None if peak is None else figure["value"] / peak.value
    return figure


def measure(backend: Backend, sizes: dict | None = None, repeat: int = 5,
            precisions: Sequence[str] | None = None) -> list[dict]:
    """Every figure ``backend`` can measure (one failing figure is recorded with its error,
    so that one missing unit does not lose the rest)."""
    sizes = sizes or SIZES[backend.kind]
    sheet = hardware.datasheet_name(backend.describe()["device"])
    figures = []
    for precision in precisions or backend.precisions():
        try:
            figures.append(_with_peak(matmul_figure(backend, precision, sizes["matmul"],
                                                    repeat), sheet))
        except Exception as exc:  # e.g. a unit the library does not reach on this device
            figures.append({"figure": "matmul", "precision": precision,
                            "backend": backend.name, "error": f"{type(exc).__name__}: {exc}"})
    try:
        copies = backend.copies(sizes["copy"])
    except Exception as exc:
        return figures + [{"figure": "copies", "backend": backend.name,
                           "error": f"{type(exc).__name__}: {exc}"}]
    for name, fn in copies.items():
        try:
            figures.append(_with_peak(copy_figure(backend, name, fn, sizes["copy"], repeat),
                                      sheet))
        except Exception as exc:
            figures.append({"figure": name, "backend": backend.name,
                            "error": f"{type(exc).__name__}: {exc}"})
    return figures


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_smi() -> dict | None:
    """What ``nvidia-smi`` reports of GPU 0 (``None`` where it is not installed)."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ["name", "driver_version", "memory.total", "clocks.max.sm", "clocks.max.memory",
              "power.limit", "pcie.link.gen.max", "pcie.link.width.max"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.splitlines()[0]
    except (subprocess.SubprocessError, OSError, IndexError):
        return None
    return dict(zip(fields, (v.strip() for v in out.split(",")), strict=False))


def record(backends: Sequence[str], sizes: dict | None = None, repeat: int = 5,
           today: str | None = None) -> dict:
    """One record: the device(s) described, every figure of every backend in ``backends``."""
    if not backends:
        raise ValueError("backends is empty: name at least one of " + ", ".join(BACKENDS))
    made = [make_backend(name) for name in backends]
    kinds = {b.kind for b in made}
    if len(kinds) > 1:
        raise ValueError(f"backends {list(backends)} measure a CPU and a GPU: one record "
                         "describes one device; record them apart")
    described = made[0].describe()
    libraries = {}
    for backend in made:
        libraries.update(backend.describe()["libraries"])
    described["libraries"] = libraries
    described["datasheet"] = hardware.datasheet_name(described["device"])
    found = {"schema": SCHEMA, "date": today or datetime.date.today().isoformat(),
             "device": described, "nvidia_smi": _nvidia_smi() if kinds == {"gpu"} else None,
             "host": {"cpu": _cpu_name(), "python": platform.python_version(),
                      "platform": platform.platform()},
             "figures": []}
    for backend in made:
        found["figures"] += measure(backend, sizes, repeat)
    return found


def format_record(found: dict) -> str:
    """The record as an aligned table: figure, precision, backend, achievable, peak, share."""
    def num(value: float) -> str:
        return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"

    head = ["figure", "precision", "backend", "achievable", "data sheet", "reached"]
    rows = []
    for f in found["figures"]:
        if "error" in f:
            rows.append([f["figure"], f.get("precision") or "-", f["backend"],
                         "error: " + f["error"][:60], "-", "-"])
            continue
        peak = f["datasheet_peak"]
        rows.append([f["figure"], f["precision"] or "-", f["backend"],
                     f"{num(f['value'])} {f['unit']}",
                     "-" if peak is None else f"{num(peak)} {f['unit']}",
                     "-" if peak is None else f"{f['fraction_of_peak']:.0%}"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
             for line in [head, *rows]]
    dev = found["device"]
    title = (f"{dev['device']} ({dev['kind']}), measured {found['date']}; data sheet: "
             f"{dev.get('datasheet') or 'not known'}")
    return "\n".join([title, *lines])


def write_record(found: dict, path: str | Path) -> Path:
    """``found`` as JSON at ``path`` (its folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return path
