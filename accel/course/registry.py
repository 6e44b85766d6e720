"""The course's benchmarks (``python -m accel bench NAME``) and figures (``make images``).

Each benchmark is a function ``bench(device_names, quick=False) -> dict`` that prints ratios
against its own baseline, measured in the same run; ``quick`` runs a tiny version (used by the
test that runs every benchmark one after another in one process). The runner creates the
devices once, with ``accel.devices.setup(4)``, and hands them to every benchmark. Each figure is a
function returning a ``matplotlib`` figure, saved under ``images/`` by the name it is registered
with. Timings never appear in unit tests.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from accel import devices

__all__ = ["BENCHMARKS", "FIGURES", "BENCH_DEVICES", "get", "run", "run_all", "list_lines",
           "save_figures", "save_measured_figure",
           "figure_run", "RUN_ID"]

BENCH_DEVICES = 4

# name -> ("module:function", one-line description)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "allreduce": ("accel.course.allreduce_bench:bench",
                  "hand ring vs TF's RING across processes; the alpha-beta model's crossovers "
                  "on 4 processes; in one process ring vs one device vs TF; packed; float16; "
                  "bytes vs formulas (chapter 13)"),
    "cluster": ("accel.course.clusters:bench",
                "start-up of 1 ps + 2 workers; the four replication combinations (chapter 12)"),
    "copy-cost": ("accel.course.copy_cost:bench",
                  "ops hopping between devices; a big tensor used elsewhere (chapter 02)"),
    "memory": ("accel.course.memory:bench_memory",
               "peak memory and step time: plain vs recompute vs mixed precision (chapter 04)"),
    "sync-async": ("accel.course.sync_async:bench_sync_async",
                   "time to a target loss of sync, async and 2-of-3, with and without a 4x "
                   "straggler, 5 repetitions (chapter 06)"),
    "model-parallel": ("accel.course.model_parallel:bench",
                       "split step vs one device, RNN wavefront vs layer after layer, idle "
                       "fractions (chapter 09)"),
    "pipeline": ("accel.course.pipeline:bench",
                 "the bubble vs (p-1)/(m+p-1), 1F1B vs GPipe, pipeline vs one device (chapter 10)"),
    "keras-pipeline": ("accel.course.pipeline:bench_keras",
                       "a Keras model pipelined: 1F1B and interleaved 1F1B idle share vs "
                       "(p-1)/(vm+p-1) on 2 devices; the same with tasks that hold no core; "
                       "two equal works in lock-step, the machine's floor (chapter 10)"),
    "pipeline-overhead": ("accel.course.pipeline:bench_overhead",
                          "a pipeline's host cost per task, and every form's step on one "
                          "device, against Keras fit (chapter 10)"),
    "tensor-parallel": ("accel.course.tensor_parallel:bench",
                        "tensor-parallel MLP and block vs one device, DTensor vs by hand, bytes "
                        "sent vs the formula (chapter 11)"),
    "zero": ("accel.course.zero:bench",
             "ZeRO stages 1-3 and optimizer offload vs plain data parallelism, bytes sent per "
             "step vs the formulas (chapter 15)"),
    "towers": ("accel.course.scaling:bench_towers",
               "step time of hand-written towers vs MirroredStrategy vs one device (chapter 07)"),
    "keras-towers": ("accel.course.scaling:bench_keras_towers",
                     "step time on a Keras CNN: DataParallel towers vs Keras under "
                     "MirroredStrategy vs Keras on one device (chapter 07)"),
    "input": ("accel.course.input_pipeline:bench_input",
              "a slow map: step time plain / prefetch / parallel map / cache vs compute alone "
              "(chapter 08)"),
}

# file name in images/ -> "module:function" returning a Figure
FIGURES: dict[str, str] = {
    "01_devices.png": "accel.course.diagrams:figure_devices",
    "02_placement.png": "accel.course.diagrams:figure_placement",
    "10_schedules.png": "accel.course.pipeline:figure_schedules",
    "11_sequence_parallel.png": "accel.course.tensor_parallel:figure_sequence_parallel",
    "13_alpha_beta.png": "accel.course.collectives:figure_alpha_beta",
    "17_planner_terms.png": "accel.course.planner:figure_terms",
    "15_zero_memory.png": "accel.course.zero:figure_zero_memory",
}


def _resolve(target: str) -> Callable:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def get(name: str) -> Callable[..., dict]:
    """The benchmark function registered as ``name``."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    return _resolve(BENCHMARKS[name][0])


def list_lines() -> list[str]:
    """``name<TAB>description`` for every benchmark, sorted by name."""
    return [f"{name}\t{text}" for name, (_, text) in sorted(BENCHMARKS.items())]


def run(name: str, quick: bool = False) -> dict:
    """Run one benchmark on the course's devices and return its numbers."""
    bench = get(name)
    return bench(devices.setup(BENCH_DEVICES), quick=quick)


def run_all(names: Sequence[str] | None = None, quick: bool = False) -> dict[str, dict]:
    """Run several benchmarks (default: all) one after another in this process."""
    names = list(names or sorted(BENCHMARKS))
    for name in names:
        get(name)  # every name is checked before anything runs
    results = {}
    for name in names:
        print(f"== {name}")
        results[name] = run(name, quick=quick)
    return results


def save_figures(out: str | Path = "images", names: Sequence[str] | None = None) -> list[Path]:
    """Build every registered figure (or just ``names``) and save it under ``out``."""
    import matplotlib.pyplot as plt

    out = Path(out)
    unknown = sorted(set(names or ()) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; registered: {sorted(FIGURES)}")
    out.mkdir(parents=True, exist_ok=True)
    saved = []
    for name in names or sorted(FIGURES):
        fig = _resolve(FIGURES[name])()
        path = out / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        saved.append(path)
    return saved


RUN_ID = os.environ.get("ACCEL_RUN_ID") or uuid.uuid4().hex[:12]
RUN_KEY = "accel-run"  # the PNG text field that holds the id of the run that drew the figure


def save_measured_figure(fig, name: str, out: str | Path = "../images") -> Path | None:
    """Save a figure that shows a measurement of this run, from the notebook cell that shows it,
    but only while ``make execute`` stores the chapter's outputs (it sets ``ACCEL_SAVE_FIGURES=1``):
    the stored numbers and the saved figure then come from the same run, and re-running the
    chapter (nbval, JupyterLab) leaves ``images/`` alone. It prints this run's id, which the
    saved PNG also carries (``figure_run``), so a test can tell a figure from another run (the
    cell calling it is a measurement: ``# NBVAL_IGNORE_OUTPUT``). Returns the path written, or
    ``None``."""
    if os.environ.get("ACCEL_SAVE_FIGURES") != "1":
        print(f"measured in run {RUN_ID} (images/{name} is saved by `make execute` only)")
        return None
    path = Path(out) / name
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={RUN_KEY: RUN_ID})
    print(f"measured in run {RUN_ID}; saved images/{name}")
    return path


def figure_run(path: str | Path) -> str | None:
    """The run id stored in a PNG saved by ``save_measured_figure``, or ``None``."""
    from PIL import Image

    with Image.open(path) as image:
        return image.text.get(RUN_KEY) if hasattr(image, "text") else None
