"""Configuring memory and threads from plain arguments: the TF1 ``ConfigProto`` and the TF2
``tf.config`` calls, with bad values refused before TensorFlow sees them.

By default TensorFlow maps nearly all of every visible GPU's memory when it creates its GPU
devices. TF1 changes that with ``GPUOptions`` (``allow_growth``,
``per_process_gpu_memory_fraction``, ``visible_device_list``) in a ``ConfigProto``; TF2 with
``tf.config`` calls made before the first op (``set_visible_devices``, ``set_memory_growth``,
logical devices with ``memory_limit``) or the environment
variable ``TF_FORCE_GPU_ALLOW_GROWTH=true``.

These options are per *process*, not per session: a process creates its GPU devices and their
allocators once, so the first session that creates them (or TF2's eager context, e.g. after
``accel.devices.setup``; in a cluster the ``tf.distribute.Server``) fixes them, and the
``gpu_options`` of later ``tf.compat.v1.Session(config=...)`` calls are ignored (a different
``visible_device_list`` is refused; tensorflow/tensorflow#3057, #22526, #32919, #19083). With
growth the allocator never gives memory back to the GPU while the process lives (TensorFlow's GPU
guide: releasing it would fragment memory).

Thread pools: ``inter_op_parallelism_threads`` (independent ops at once) and
``intra_op_parallelism_threads`` (threads inside one op), also fixed once TensorFlow has started.
A TF1 session without ``use_per_session_threads`` runs on one process-wide inter-op pool, created
by the first such session with that session's size; ``use_per_session_threads=True`` gives the
session a pool of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tensorflow as tf

__all__ = ["tf1_config", "tf1_config_fields", "GpuMemoryPlan", "gpu_memory_plan",
           "apply_gpu_memory_plan"]

_FIELDS = ("allow_growth", "memory_fraction", "visible_devices", "inter_op_threads",
           "intra_op_threads", "use_per_session_threads")


def _check_devices(visible: Sequence[int] | None) -> tuple[int, ...] | None:
    if visible is None:
        return None
    out = tuple(visible)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in out) or \
            len(set(out)) != len(out):
        raise ValueError(f"visible devices must be distinct GPU indices >= 0, got {visible!r}")
    return out


def _check_threads(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be an int >= 0 (0: let TensorFlow choose), got {value!r}")


def tf1_config(allow_growth: bool | None = None, memory_fraction: float | None = None,
               visible_devices: Sequence[int] | None = None, inter_op_threads: int | None = None,
               intra_op_threads: int | None = None, use_per_session_threads: bool | None = None,
               **extra) -> tf.compat.v1.ConfigProto:
    """A TF1 ``ConfigProto`` for ``tf.compat.v1.Session(config=...)``; ``None``: field unset.

    The GPU fields take effect only in the session that creates the process's GPU devices
    (see the module docstring). ``memory_fraction``:
    ``gpu_options.per_process_gpu_memory_fraction``, in (0, 1]; ``visible_devices``:
    ``gpu_options.visible_device_list`` (GPU indices); threads: 0 lets TensorFlow choose.
    ``extra``: other top-level fields, e.g. ``allow_soft_placement=True``.
    """
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction is the share of each GPU's memory to map, in (0, 1]; "
                         f"got {memory_fraction!r}")
    visible = _check_devices(visible_devices)
    _check_threads("inter_op_threads", inter_op_threads)
    _check_threads("intra_op_threads", intra_op_threads)
    config = tf.compat.v1.ConfigProto(**extra)
    if allow_growth is not None:
        config.gpu_options.allow_growth = bool(allow_growth)
    if memory_fraction is not None:
        config.gpu_options.per_process_gpu_memory_fraction = float(memory_fraction)
    if visible is not None:
        config.gpu_options.visible_device_list = ",".join(map(str, visible))
    if inter_op_threads is not None:
        config.inter_op_parallelism_threads = inter_op_threads
    if intra_op_threads is not None:
        config.intra_op_parallelism_threads = intra_op_threads
    if use_per_session_threads is not None:
        config.use_per_session_threads = bool(use_per_session_threads)
    return config


def tf1_config_fields(config: tf.compat.v1.ConfigProto) -> dict[str, object]:
    """The arguments of ``tf1_config`` that ``config`` sets (the inverse of ``tf1_config``).

    Protocol-buffer fields have no "unset": a field at its default (False, 0) reads as unset."""
    gpu = config.gpu_options
    values = {
        "allow_growth": gpu.allow_growth or None,
        "memory_fraction": gpu.per_process_gpu_memory_fraction or None,
        "visible_devices": tuple(int(i) for i in gpu.visible_device_list.split(","))
        if gpu.visible_device_list else None,
        "inter_op_threads": config.inter_op_parallelism_threads or None,
        "intra_op_threads": config.intra_op_parallelism_threads or None,
        "use_per_session_threads": config.use_per_session_threads or None,
    }
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class GpuMemoryPlan:
    """What to do to each visible GPU before TensorFlow starts (see ``gpu_memory_plan``)."""

    growth: bool = False
    memory_limits_mb: tuple[int, ...] = ()
    visible: tuple[int, ...] | None = None

    def calls(self) -> list[str]:
        """The TF2 calls this plan makes, as text (``gpu`` is each visible physical GPU)."""
        out = []
        if self.visible is not None:
            out.append(f"tf.config.set_visible_devices([gpus[i] for i in {list(self.visible)}],"
                       " 'GPU')")
        if self.growth:
            out.append("tf.config.experimental.set_memory_growth(gpu, True)")
        if self.memory_limits_mb:
            cfgs = ", ".join(f"LogicalDeviceConfiguration(memory_limit={m})"
                             for m in self.memory_limits_mb)
            out.append(f"tf.config.set_logical_device_configuration(gpu, [{cfgs}])")
        return out

    def env(self) -> dict[str, str]:
        """The environment-variable form, where there is one (growth only)."""
        return {"TF_FORCE_GPU_ALLOW_GROWTH": "true"} if self.growth else {}


def gpu_memory_plan(growth: bool = False, memory_limit_mb: int | Sequence[int] | None = None,
                    visible: Sequence[int] | None = None) -> GpuMemoryPlan:
    """A checked plan: memory growth, or each GPU split into logical GPUs of ``memory_limit_mb``
    (an int: one logical GPU with that limit), on the ``visible`` GPUs (default: all).

    TensorFlow refuses growth together with a limit on the same device, so does this, early.
    """
    limits = () if memory_limit_mb is None else (
        (memory_limit_mb,) if isinstance(memory_limit_mb, int) else tuple(memory_limit_mb))
    if any(isinstance(m, bool) or not isinstance(m, int) or m <= 0 for m in limits):
        raise ValueError(f"memory_limit_mb must be positive ints (MiB), got {memory_limit_mb!r}")
    if growth and limits:
        raise ValueError("memory growth and a memory_limit cannot both be set on the same device: "
                         "growth lets the device's memory grow on demand, a limit fixes it; "
                         "choose one")
    return GpuMemoryPlan(bool(growth), limits, _check_devices(visible))


def apply_gpu_memory_plan(plan: GpuMemoryPlan, gpus: Sequence | None = None) -> list[str]:
    """Apply ``plan`` to ``gpus`` (default: the physical GPUs); return the calls made.

    Must run before TensorFlow's first op (else TensorFlow raises ``RuntimeError``). Given a CPU
    device, TensorFlow itself raises ``ValueError``: these options exist for GPUs only.
    """
    gpus = list(tf.config.list_physical_devices("GPU") if gpus is None else gpus)
    if plan.visible is not None and any(i >= len(gpus) for i in plan.visible):
        raise ValueError(f"visible={list(plan.visible)} names a GPU index that does not exist: "
                         f"this process has {len(gpus)} GPU(s)")
    if plan.visible is not None:
        tf.config.set_visible_devices([gpus[i] for i in plan.visible], "GPU")
        gpus = [gpus[i] for i in plan.visible]
    for gpu in gpus:
        if plan.growth:
            tf.config.experimental.set_memory_growth(gpu, True)
        if plan.memory_limits_mb:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=m)
                      for m in plan.memory_limits_mb])
    return plan.calls() if gpus else []
