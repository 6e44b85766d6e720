"""The checking side of ``accel.memory``: what TensorFlow really holds during a training step.

* ``memory_device()``: the device whose allocator a step uses (``GPU:0`` if any, else ``CPU:0``);
* ``peak_during(fn, device)``: the allocator's peak above the level before ``fn`` ran;
* ``tape_kept_tensors`` / ``tape_kept_bytes``: the forward tensors the backward pass reads;
* ``measure_step_peak``: the peak of one eager training step;
* ``measure_conv_workspace``: the scratch this machine's convolution kernels take
  (``input_gradient_needed``: whether a step computes a layer's input gradient).

On CPU, with oneDNN off (as ``accel.course`` sets it), the allocator reports only when
``TF_CPU_ALLOCATOR_USE_BFC=true`` was set before TensorFlow created its devices, at its first op
(see ``accel.memory.estimate``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import tensorflow as tf

from accel import checks
from accel.memory.estimate import POLICIES, nbytes, tensor_bytes

__all__ = ["memory_device", "peak_during", "tape_kept_tensors", "tape_kept_bytes",
           "measure_step_peak", "measure_conv_workspace", "input_gradient_needed"]

_SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank")
_ALIAS_OPS = ("Reshape", "Identity", "Squeeze", "ExpandDims")
_NOT_ACTIVATIONS = ("ReadVariableOp", "Placeholder", "Const", "VarHandleOp", *_SHAPE_OPS)
_CONV_LAYERS = ("Conv1D", "Conv2D", "Conv3D")


def memory_device() -> str:
    """The device whose allocator a step runs on: ``"GPU:0"`` if there is one, else ``"CPU:0"``."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _current(device: str) -> int:
    try:
        return tf.config.experimental.get_memory_info(device)["current"]
    except ValueError as exc:
        raise RuntimeError(
            f"TensorFlow reports no memory statistics for {device}: on CPU set "
            "TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow's first op "
            f"(now: {os.environ.get('TF_CPU_ALLOCATOR_USE_BFC', 'unset')}), then restart") from exc


def peak_during(fn: Callable[[], object], device: str) -> tuple[int, object]:
    """Run ``fn``; return (peak bytes above the level before it, fn's result)."""
    gc.collect()  # dead Python objects freeing their tensors mid-measurement would hide bytes
    before = _current(device)
    tf.config.experimental.reset_memory_stats(device)
    out = fn()
    return tf.config.experimental.get_memory_info(device)["peak"] - before, out


def tape_kept_tensors(model, x) -> list[tuple[str, tuple, str]]:
    """The forward tensors the backward pass of ``model`` on ``x`` reads: ``(reader op type,
    shape, dtype)`` each. Exact and deterministic: the step (forward, tape, gradients) is traced
    as a ``tf.function`` graph, where every gradient op names its inputs. Not counted: variable
    reads (the weights themselves), the input batch, shape-only uses; a reshape counts as the
    tensor it views. The loss is a plain mean (its gradient needs only a shape)."""
    @tf.function(autograph=False)
    def grads(inp):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.cast(model(inp, training=True), tf.float32))
        return tape.gradient(loss, model.trainable_variables)

    graph = grads.get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
    # backward ops: the tape's scope, and what reads its results (the AddN that sums the
    # gradients of a tensor read twice is made outside that scope); ops come in creation order
    backward: set[str] = set()
    for op in graph.get_operations():
        if op.name.startswith("gradient_tape/") or any(t.op.name in backward for t in op.inputs):
            backward.add(op.name)
    kept: dict[str, tuple[str, tuple, str]] = {}
    for op in graph.get_operations():
        if op.name not in backward or op.type in _SHAPE_OPS:
            continue
        for t in op.inputs:
            while t.op.type in _ALIAS_OPS:
                t = t.op.inputs[0]
            if not (t.op.name in backward or t.op.type in _NOT_ACTIVATIONS):
                kept.setdefault(t.name, (op.type, tuple(t.shape), t.dtype.name))
    return list(kept.values())


def tape_kept_bytes(model, x) -> int:
    """Bytes of ``tape_kept_tensors(model, x)``: the activations one training step keeps."""
    return sum(nbytes(shape, dtype) for _, shape, dtype in tape_kept_tensors(model, x))


def measure_step_peak(model, optimizer, x, y, loss_fn) -> int:
    """Peak bytes of one eager training step (forward, gradients, optimizer update).

    Runs one step first (it creates the slots), then measures: the allocator's peak above the
    level before the step (so other live tensors of the process do not count) plus the bytes of
    the state the step needs that was already there -- the model's variables, the optimizer's
    variables, ``x`` and ``y`` -- counted from the real tensors.
    """
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return float(loss)

    step()
    extra, _ = peak_during(step, memory_device())
    return extra + tensor_bytes([*model.variables, *optimizer.variables, x, y])


def input_gradient_needed(model, index: int) -> bool:
    """Whether a training step of ``model`` computes the gradient of the input of
    ``model.layers[index]``: only if a layer before it (in ``model.layers`` order) has trainable
    weights. The model's own input is data, not a variable: nothing asks for its gradient."""
    if isinstance(index, bool) or not isinstance(index, int) or \
            not 0 <= index < len(model.layers):
        raise ValueError(f"index must be an int in [0, {len(model.layers)}) (the layers of "
                         f"{model.name!r}), got {index!r}")
    return any(layer.trainable_weights for layer in model.layers[:index])


def measure_conv_workspace(model, batch_size: int, policy: str = "float32") -> int:
    """The scratch bytes the convolution kernels of *this machine* take in a training step of
    ``model`` at ``batch_size``: the largest, over the model's Conv1D/2D/3D layers, of the
    allocator's peak during one forward + backward pass of that convolution alone minus the
    tensors that pass must hold (output, output gradient, the gradients it computes). 0 for a
    model without such a layer. The pass computes the kernel's gradient, and the input's only
    where the training step needs it: a convolution with no trainable layer before it (the
    model's first) gets no input gradient in a step, so none is measured for it (layers are
    taken in ``model.layers`` order: exact for a ``Sequential`` model, and for a functional one
    it may measure an input gradient that a parallel branch would not need).

    Why measure: the scratch belongs to the kernel library, not to the model. TensorFlow's Eigen
    kernels take ~``CPU_CONV_WORKSPACE`` whatever the shapes; oneDNN (TensorFlow's default in
    its x86 Windows builds and on Linux CPUs with AVX-512 VNNI / BF16, AVX-VNNI or AMX, or ARM
    Neoverse V1: ``DefaultOneDnnPolicy`` in tensorflow/core/util/port.cc) and cuDNN size theirs
    by shape and algorithm. Needs memory statistics (on CPU: ``TF_CPU_ALLOCATOR_USE_BFC=true``
    before TensorFlow's first op).
    """
    checks.positive_int("batch_size", batch_size)
    checks.one_of("policy", policy, POLICIES)
    compute = POLICIES[policy][1]
    device = memory_device()
    workspace = 0
    for index, layer in enumerate(model.layers):
        if type(layer).__name__ not in _CONV_LAYERS:
            continue
        if getattr(layer, "data_format", "channels_last") != "channels_last":
            raise ValueError(f"layer {layer.name!r}: data_format {layer.data_format!r} is not "
                             "supported; measure_conv_workspace handles 'channels_last'")
        x = tf.zeros((batch_size, *layer.input.shape[1:]), compute)
        kernel = tf.cast(layer.kernel, compute)
        sources = [x, kernel] if input_gradient_needed(model, index) else [kernel]

        def probe(layer=layer, x=x, kernel=kernel, sources=sources):
            with tf.GradientTape() as tape:
                tape.watch(sources)
                out = tf.nn.convolution(x, kernel, strides=layer.strides,
                                        padding=layer.padding.upper(),
                                        dilations=layer.dilation_rate)
                loss = tf.reduce_sum(out)
            grads = tape.gradient(loss, sources)
            return 2 * tensor_bytes([out]) + tensor_bytes(grads)

        probe()  # the first call may set up kernels and caches
        peak, held = peak_during(probe, device)
        workspace = max(workspace, peak - held)
    return workspace
