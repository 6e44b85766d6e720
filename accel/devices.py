"""Devices: names in all their spellings, physical vs logical devices, and the course's ``setup()``.

``setup(count)`` is the first call of every chapter: it gives you ``count`` devices to place work
on -- real GPUs when there are enough, else one GPU split into logical GPUs, else the CPU split
into logical ("virtual") CPUs. Virtual CPUs share the same cores: they show placement,
communication and schedules faithfully, but not GPU speed-ups.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

import numpy as np
import tensorflow as tf  # accel/__init__ has set TF_CPP_MIN_LOG_LEVEL already

__all__ = [
    "setup",
    "parse_device",
    "normalize_device",
    "merge_devices",
    "DeviceRow",
    "device_table",
    "format_table",
    "report",
    "fresh_process_devices",
]

KINDS = ("auto", "cpu", "gpu")
DEFAULT_GPU_SPLIT_MB = 1024

_state: dict[str, object] = {}


def _set_seeds(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)


def _quiet() -> None:
    tf.get_logger().setLevel("ERROR")
    try:  # absl is what TensorFlow's Python logging goes through
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover - absl ships with tensorflow
        pass


def _configure(count: int, kind: str, gpu_memory_mb: int) -> str:
    """Configure logical devices; return the device type used ("CPU" or "GPU")."""
    gpus = tf.config.list_physical_devices("GPU")
    if kind == "gpu" and not gpus:
        raise RuntimeError("setup(kind='gpu') needs a physical GPU and this machine has none; "
                           "use kind='auto' or kind='cpu'")
    if kind in ("auto", "gpu") and len(gpus) >= count:
        tf.config.set_visible_devices(gpus[:count], "GPU")
        return "GPU"
    if kind in ("auto", "gpu") and gpus:
        split = [tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_mb)] * count
        tf.config.set_visible_devices(gpus[:1], "GPU")
        tf.config.set_logical_device_configuration(gpus[0], split)
        return "GPU"
    cpu = tf.config.list_physical_devices("CPU")[0]
    split = [tf.config.LogicalDeviceConfiguration()] * count
    tf.config.set_logical_device_configuration(cpu, split)
    return "CPU"


def setup(count: int = 4, kind: str = "auto", seed: int = 0,
          gpu_memory_mb: int = DEFAULT_GPU_SPLIT_MB) -> list[str]:
    """Create ``count`` devices to work on and return their names (e.g. ``'/device:CPU:2'``).

    ``kind="auto"``: ``count`` real GPUs if there are that many, else the first GPU split into
    ``count`` logical GPUs of ``gpu_memory_mb`` each, else the CPU split into ``count`` logical
    CPUs. ``kind="cpu"`` always splits the CPU; ``kind="gpu"`` refuses to run without a GPU.

    Also seeds Python, NumPy and TensorFlow with ``seed`` and silences TensorFlow's Python INFO
    logging. Idempotent: calling it again with the same arguments returns the same names.
    Logical devices can only be configured before TensorFlow runs its first op, so asking for a
    different configuration afterwards raises ``RuntimeError`` (restart the kernel).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if gpu_memory_mb <= 0:
        raise ValueError(f"gpu_memory_mb must be positive, got {gpu_memory_mb!r}")
    _quiet()
    _set_seeds(seed)
    key = (count, kind)
    if _state.get("key") == key:
        return list(_state["names"])  # type: ignore[arg-type]
    if "key" in _state:
        raise RuntimeError(
            f"accel.devices.setup was already called with count={_state['key'][0]}, "
            f"kind={_state['key'][1]!r}; TensorFlow's devices are fixed once it has started, so "
            f"count={count}, kind={kind!r} needs a fresh process: restart the kernel")
    try:
        device_type = _configure(count, kind, gpu_memory_mb)
    except RuntimeError as exc:
        if "cannot be modified after being initialized" not in str(exc):
            raise
        device_type = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
        if len(tf.config.list_logical_devices(device_type)) != count:
            raise RuntimeError(
                f"TensorFlow is already initialised with "
                f"{len(tf.config.list_logical_devices(device_type))} {device_type} device(s), so "
                f"setup(count={count}) cannot take effect: restart the kernel and call "
                "accel.devices.setup(...) before any other TensorFlow code") from exc
    names = [d.name for d in tf.config.list_logical_devices(device_type)][:count]
    _state.update(key=key, names=names)
    return list(names)


# --------------------------------------------------------------------------- device names
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_FIELD = re.compile(
    rf"^(?:job:(?P<job>{_NAME})|replica:(?P<replica>\d+)|task:(?P<task>\d+)"
    rf"|device:(?P<dtype>{_NAME}):(?P<dindex>\d+|\*)|(?P<short>cpu|gpu|tpu):(?P<sindex>\d+|\*))$",
    re.IGNORECASE)


def parse_device(name: str) -> tf.DeviceSpec:
    """Parse a device string strictly into a ``tf.DeviceSpec``.

    Accepts every spelling TensorFlow accepts: ``/cpu:0``, ``/GPU:1``, ``/device:GPU:1``,
    ``/job:worker/replica:0/task:1/device:GPU:0`` and partial forms such as ``/job:ps``.
    Anything else (``/gpu:x``, ``/job:worker/task:-1``, a field given twice) is a ``ValueError``
    naming the string, where ``tf.DeviceSpec`` would sometimes accept it silently.
    """
    if not isinstance(name, str):
        raise ValueError(f"a device name must be a string, got {name!r}")
    if name == "":
        return tf.DeviceSpec()
    if not name.startswith("/"):
        raise ValueError(f"device name {name!r} must start with '/', e.g. '/cpu:0' or '/job:ps'")
    fields: dict[str, object] = {}
    for part in name[1:].split("/"):
        m = _FIELD.match(part)
        if m is None:
            raise ValueError(
                f"device name {name!r}: cannot parse {part!r}; allowed parts are job:NAME, "
                "replica:N, task:N, device:TYPE:N (or N='*') and cpu:N / gpu:N with N >= 0")
        g = {k: v for k, v in m.groupdict().items() if v is not None}
        if "short" in g:
            g = {"dtype": g["short"], "dindex": g["sindex"]}
        for key, value in g.items():
            if key in fields:
                label = {"dtype": "device", "dindex": "device index"}.get(key, key)
                raise ValueError(f"device name {name!r} gives the {label} twice")
            fields[key] = value
    index = fields.get("dindex")
    return tf.DeviceSpec(
        job=fields.get("job"),
        replica=int(fields["replica"]) if "replica" in fields else None,
        task=int(fields["task"]) if "task" in fields else None,
        device_type=str(fields["dtype"]).upper() if "dtype" in fields else None,
        device_index=None if index in (None, "*") else int(index),
    )


def normalize_device(name: str) -> str:
    """The canonical spelling of a device name: ``'/gpu:1'`` -> ``'/device:GPU:1'``."""
    return parse_device(name).to_string()


def merge_devices(outer: str, inner: str) -> str:
    """What nested ``tf.device(outer)`` / ``tf.device(inner)`` blocks request: fields set by
    ``inner`` win, the rest come from ``outer`` (both are validated first)."""
    return parse_device(outer).make_merged_spec(parse_device(inner)).to_string()


# --------------------------------------------------------------------------- device table
@dataclass(frozen=True)
class DeviceRow:
    """One row of the device table."""

    name: str
    device_type: str
    level: str  # "physical" or "logical"
    memory_mb: int | None  # None where TensorFlow does not know it
    detail: str = ""


def _host_memory_mb() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def device_table() -> list[DeviceRow]:
    """Physical devices, then the logical devices TensorFlow made from them.

    Memory: host RAM for the physical CPU (logical CPUs share it, so ``None``), the configured
    limit for logical GPUs, and the device's details for physical GPUs where TensorFlow has them.
    """
    rows = []
    for dev in tf.config.list_physical_devices():
        details = tf.config.experimental.get_device_details(dev) if dev.device_type == "GPU" else {}
        memory = _host_memory_mb() if dev.device_type == "CPU" else None
        detail = str(details.get("device_name", "")) if details else ""
        rows.append(DeviceRow(dev.name, dev.device_type, "physical", memory, detail))
    limits: dict[str, list] = {}
    for dev in tf.config.list_physical_devices("GPU"):
        limits[dev.name] = tf.config.get_logical_device_configuration(dev) or []
    gpu_limits = [c.memory_limit for cfgs in limits.values() for c in cfgs]
    gpu_i = 0
    for dev in tf.config.list_logical_devices():
        memory = None
        if dev.device_type == "GPU" and gpu_i < len(gpu_limits):
            memory = gpu_limits[gpu_i]
        gpu_i += dev.device_type == "GPU"
        rows.append(DeviceRow(dev.name, dev.device_type, "logical", memory))
    return rows


def format_table(rows: list[DeviceRow], memory: bool = True) -> str:
    """Render device rows as aligned text (``memory=False`` drops the machine-specific column)."""
    header = ["name", "type", "level"] + (["memory"] if memory else []) + ["detail"]
    body = []
    for r in rows:
        mem = [f"{r.memory_mb} MiB" if r.memory_mb is not None else "-"] if memory else []
        body.append([r.name, r.device_type, r.level, *mem, r.detail])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *body]]
    return "\n".join(lines)


def report() -> str:
    """The device report printed by ``python -m accel devices``."""
    build = tf.sysconfig.get_build_info()
    lines = [
        f"TensorFlow {tf.__version__}; built with CUDA: {bool(build.get('is_cuda_build'))}",
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(not set)')}",
        "",
        format_table(device_table()),
    ]
    return "\n".join(lines)


_PROBE = """
import json, os
{before}
import tensorflow as tf
{after}
print("ACCEL_PROBE" + json.dumps({{
    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "physical": [d.name for d in tf.config.list_physical_devices()],
    "logical": [d.name for d in tf.config.list_logical_devices()]}}))
"""


def fresh_process_devices(env: dict[str, str] | None = None, before_import: str = "",
                          after_import: str = "", timeout: float = 120) -> dict:
    """What a *new* Python process sees: physical and logical devices, and its
    ``CUDA_VISIBLE_DEVICES``. ``env`` is added to this process's environment (as a shell prefix
    would); ``before_import`` / ``after_import`` are code run before / after ``import
    tensorflow``. Device visibility is decided once per process, hence the fresh interpreter."""
    import json
    import subprocess
    import sys

    code = _PROBE.format(before=before_import, after=after_import)
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ACCEL_PROBE")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the probe process failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(line[len("ACCEL_PROBE"):])
