"""Where training memory goes: weights, gradients, optimizer slots, activations -- estimated from
a model's shapes, and checked against the tensors TensorFlow really holds.

``estimate_training_memory(model, optimizer="adam", policy="float32", batch_size=64)`` returns a
``MemoryEstimate`` (bytes per part, ``total`` = the estimated peak of one training step);
``format_estimates`` prints several side by side; ``tensor_bytes`` counts real tensors. The
checking side (what TensorFlow really holds and its allocator's peaks) is ``accel.memory.measure``.

Measuring on CPU: with oneDNN off (as ``accel.course`` sets it),
``tf.config.experimental.get_memory_info("CPU:0")`` only reports when the environment has
``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow creates its devices, at its first op
(``ProcessState::GetCPUAllocator`` reads it when it makes the host allocator; TensorFlow then
uses its BFC allocator for host memory, the one it uses on GPUs). With oneDNN on, its ``mklcpu``
allocator reports as well. There is one host allocator per process, so all logical CPUs of
``accel.devices.setup`` share it: ``"CPU:0"`` reports them all.

Recomputation and mixed precision: ``accel.memory.savings``; configuration builders:
``accel.memory.config``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import tensorflow as tf

from accel import checks

__all__ = [
    "OPTIMIZERS", "POLICIES", "CPU_CONV_WORKSPACE", "MemoryEstimate", "make_optimizer",
    "estimate_training_memory", "activation_bytes", "format_estimates",
    "mixed_precision_accounting", "tensor_bytes", "nbytes", "slot_variables", "MIB",
]

# optimizer name -> slot tensors it keeps per trainable variable (same shape and dtype)
OPTIMIZERS: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}
# policy -> (variable dtype, compute dtype), as in Keras' dtype policies
POLICIES: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float32"),
    "mixed_float16": ("float32", "float16"),
    "mixed_bfloat16": ("float32", "bfloat16"),
}
_VIEW_LAYERS = ("InputLayer", "Flatten", "Reshape")  # their output shares its input's buffer
MIB = 2**20
# Scratch of a convolution's backward pass on CPU, the rule of thumb used when nothing is
# measured: TensorFlow's own kernels unfold the images into a buffer of whole images sized for a
# 30 MiB cache ("target_working_set_size" in conv_grad_*_ops), whatever the batch. On TF 2.21
# (AVX2 CPU) the step stats of the course's small convolutions show 18-32 MiB of temporary memory
# per gradient op, depending on shapes, batch and how the allocator rounds its chunks; other
# kernel libraries (oneDNN, on by default in TensorFlow's x86 Windows builds and on Linux CPUs
# with AVX-512 VNNI / BF16, AVX-VNNI or AMX, or ARM Neoverse V1: ``DefaultOneDnnPolicy`` in
# tensorflow/core/util/port.cc) size their scratch differently.
# Chapter 04 uses ``measure_conv_workspace`` (this machine's figure) instead of this constant.
CPU_CONV_WORKSPACE = 32 * MIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of each part of one training step; ``total`` is the estimated peak.

    ``batch``: the input and label tensors. ``workspace``: scratch buffers of the backward pass
    (on CPU, convolutions unfold their input: see ``activation_bytes``). Optimizer scalars (the
    iteration counter, the learning rate: 12 bytes) are not counted.
    """

    weights: int
    gradients: int
    optimizer_slots: int
    activations: int = 0
    workspace: int = 0
    batch: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, int]:
        """The parts and the total, in bytes."""
        return {**asdict(self), "total": self.total}


def make_optimizer(name: str, learning_rate: float = 1e-3):
    """The Keras optimizer behind a name of ``OPTIMIZERS`` ("momentum" is SGD with 0.9)."""
    checks.one_of("optimizer", name, OPTIMIZERS)
    if name == "adam":
        return tf.keras.optimizers.Adam(learning_rate)
    return tf.keras.optimizers.SGD(learning_rate, momentum=0.9 if name == "momentum" else 0.0)


def nbytes(shape, dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``: elements x the dtype's size."""
    return int(tf.TensorShape(shape).num_elements()) * tf.as_dtype(dtype).size


def tensor_bytes(tensors: Sequence) -> int:
    """Bytes held by real tensors or variables (shape x dtype size, summed)."""
    return sum(nbytes(t.shape, t.dtype) for t in tensors)


def slot_variables(optimizer) -> list:
    """The optimizer's slot variables: every variable except its scalars (iteration counter,
    learning rate, loss scale), i.e. those shaped like a trainable variable."""
    return [v for v in optimizer.variables if len(v.shape) > 0]


def _layer_out(layer, batch_size: int, dtype: str) -> int:
    return batch_size * nbytes(layer.output.shape[1:], dtype)


def activation_bytes(model, batch_size: int, policy: str = "float32",
                     conv_workspace: int | None = None) -> tuple[int, int]:
    """``(activations, workspace)`` of one training step of a built Keras ``model``.

    Activations, the rule the course checks against what the tape keeps (tests/test_memory.py):
    each layer's output in the compute dtype, except views (Flatten, Reshape). Under a mixed
    policy the tape also keeps the half-precision copies of the kernels (but the first, whose
    input needs no gradient) and of the model input, which the layers cast at every step.
    Workspace, the largest transient of the step (a rule of thumb, checked to 20% on the course's
    models; transients of different phases are not alive together): the widest layer output
    (the gradient flowing back through it) plus twice the largest variable (its gradient and the
    optimizer's update temporaries), or, if the model has a convolution and that is larger, the
    scratch of its backward pass: ``conv_workspace`` bytes if given (e.g. from
    ``measure_conv_workspace``), else the rule of thumb ``CPU_CONV_WORKSPACE`` (TensorFlow's
    Eigen kernels on CPU work in cache-sized shards; oneDNN and cuDNN pick their own scratch).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    checks.one_of("policy", policy, POLICIES)
    compute = POLICIES[policy][1]
    layers = [la for la in model.layers if type(la).__name__ not in _VIEW_LAYERS]
    acts = sum(_layer_out(layer, batch_size, compute) for layer in layers)
    if compute != "float32":
        kernels = [v for v in model.trainable_variables if len(v.shape) >= 2][1:]
        acts += sum(nbytes(v.shape, compute) for v in kernels)
        acts += sum(batch_size * nbytes(t.shape[1:], compute) for t in model.inputs)
    has_conv = any(type(la).__name__.startswith("Conv") for la in layers)
    widest = max((_layer_out(la, batch_size, compute) for la in layers), default=0)
    largest = max((nbytes(v.shape, v.dtype) for v in model.trainable_variables), default=0)
    if conv_workspace is not None and conv_workspace < 0:
        raise ValueError(f"conv_workspace must be >= 0 bytes or None, got {conv_workspace}")
    conv = CPU_CONV_WORKSPACE if conv_workspace is None else conv_workspace
    return acts, max(widest + 2 * largest, conv if has_conv else 0)


def estimate_training_memory(model_or_variables, optimizer: str = "adam",
                             policy: str = "float32", batch_size: int | None = None,
                             label_bytes_per_example: int = 4,
                             conv_workspace: int | None = None) -> MemoryEstimate:
    """Estimate the memory of one training step from shapes alone.

    ``model_or_variables``: a built Keras model, or a list of variables (then activations,
    workspace and batch are 0). Weights and gradients: the trainable variables in their own
    dtype (float32 under every policy of ``POLICIES``: Keras keeps float32 master weights and
    returns float32 gradients); slots: ``OPTIMIZERS[optimizer]`` copies of them. With a model and
    ``batch_size``: activations and workspace from ``activation_bytes``, and the batch (inputs in
    their dtype plus ``label_bytes_per_example``, an int32 label by default).
    ``conv_workspace``: see ``activation_bytes`` (default: the rule of thumb).
    """
    checks.one_of("optimizer", optimizer, OPTIMIZERS)
    checks.one_of("policy", policy, POLICIES)
    is_model = hasattr(model_or_variables, "trainable_variables")
    variables = model_or_variables.trainable_variables if is_model else list(model_or_variables)
    weights = tensor_bytes(variables)
    slots = OPTIMIZERS[optimizer] * weights
    parts = dict(weights=weights, gradients=weights, optimizer_slots=slots)
    if is_model and batch_size is not None:
        acts, work = activation_bytes(model_or_variables, batch_size, policy, conv_workspace)
        inputs = sum(batch_size * nbytes(t.shape[1:], t.dtype) for t in model_or_variables.inputs)
        parts.update(activations=acts, workspace=work,
                     batch=inputs + batch_size * label_bytes_per_example)
    return MemoryEstimate(**parts)


def format_estimates(estimates: Mapping[str, MemoryEstimate], unit: str = "MiB") -> str:
    """A table, one column per estimate, one row per part (and the total)."""
    scale = {"B": 1, "KiB": 2**10, "MiB": MIB}
    checks.one_of("unit", unit, scale)
    if not estimates:
        raise ValueError("estimates is empty: pass a mapping name -> MemoryEstimate")
    rows = list(next(iter(estimates.values())).as_dict())
    width = max(10, *(len(k) for k in estimates))
    lines = [f"{'(' + unit + ')':16s}" + "".join(f"{k:>{width + 2}s}" for k in estimates)]
    for row in rows:
        vals = "".join(f"{e.as_dict()[row] / scale[unit]:{width + 2}.2f}"
                       for e in estimates.values())
        lines.append(f"{row:16s}{vals}")
    return "\n".join(lines)


def mixed_precision_accounting(optimizer: str = "adam") -> dict[str, dict[str, int]]:
    """Bytes per parameter: float32 training, the classic mixed-precision recipe (half weights
    and gradients, float32 master weights and slots: 2 + 2 + 12 for Adam), and what Keras keeps
    (float32 variables and gradients, float32 slots, half copies made each step)."""
    checks.one_of("optimizer", optimizer, OPTIMIZERS)
    slots = {f"slot {i + 1} (fp32)": 4 for i in range(OPTIMIZERS[optimizer])}
    return {
        "float32": {"weights (fp32)": 4, "gradients (fp32)": 4, **slots},
        "classic mixed": {"weights (fp16)": 2, "gradients (fp16)": 2,
                          "master weights (fp32)": 4, **slots},
        "keras mixed": {"weights (fp32)": 4, "gradients (fp32)": 4, **slots,
                        "per-step copies (fp16)": 2},
    }
