"""A model as a list of layers, the plain data that model and pipeline parallelism cut up.

A *layer* is a Keras layer (trainable weights only; built on first use) or a pair
``(fn, arrays)`` where ``fn(params, x)`` computes the layer with ``params`` (variables or
tensors, in the order of ``arrays``). ``describe_layers(layers, input_shape)`` checks that the
layers chain (each takes its predecessor's output: a ``ValueError`` naming the layer and the
shape otherwise) and returns one ``LayerSpec`` per layer: name, function, initial arrays,
output shape per example and parameter bytes. ``run_layers`` applies specs in order;
``layer_times`` measures each layer's forward and backward time (a cost to balance by);
``mlp_layers(sizes)`` is the course's MLP (``accel.models.mlp_init``) as such a list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from accel import checks, models, timing
from accel.devices import parse_device

__all__ = ["LayerSpec", "describe_layers", "run_layers", "layer_times", "dense", "linear",
           "mlp_layers"]


@dataclass(frozen=True)
class LayerSpec:
    """One layer as data: ``fn(params, x)``, its initial arrays, its output per example."""

    name: str
    fn: Callable = field(repr=False)
    arrays: tuple = field(repr=False)
    output_shape: tuple
    param_bytes: int


def _keras_fn(layer) -> Callable:
    def fn(params, x):
        return layer.stateless_call(list(params), [], x)[0]
    return fn


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def describe_layers(layers: Sequence, input_shape: Sequence[int]) -> list[LayerSpec]:
    """Check that ``layers`` chain for inputs of ``input_shape`` (one example, no batch axis)
    and describe each; a layer that cannot take its predecessor's output is a ``ValueError``."""
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: give at least one layer")
    shape = tuple(checks.positive_int("input_shape", int(d)) for d in input_shape)
    specs, x = [], tf.zeros((1, *shape))
    for i, layer in enumerate(layers):
        before = f"the input (shape {list(shape)})" if i == 0 else \
            f"layer {i - 1}'s output (shape {list(shape)})"
        if isinstance(layer, tf.keras.layers.Layer):
            name, fn = layer.name, _keras_fn(layer)
            try:
                if not layer.built:
                    layer(x)
            except Exception as exc:  # Keras raises several types for a wrong input shape
                raise ValueError(f"layer {i} ({name}) does not take {before}: "
                                 f"{_first_line(exc)}") from exc
            if layer.non_trainable_weights:
                raise ValueError(f"layer {i} ({name}) has non-trainable weights; only layers "
                                 "with trainable weights alone can be split")
            arrays = tuple(np.asarray(w.numpy()) for w in layer.trainable_weights)
        elif isinstance(layer, tuple) and len(layer) == 2 and callable(layer[0]):
            name, fn = f"layer_{i}", layer[0]
            arrays = tuple(np.asarray(a, np.float32) for a in layer[1])
        else:
            raise ValueError(f"layer {i} must be a Keras layer or a pair (fn, arrays), got "
                             f"{type(layer).__name__}")
        try:
            x = fn([tf.constant(a) for a in arrays], x)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as exc:
            raise ValueError(f"layer {i} ({name}) does not take {before}: "
                             f"{_first_line(exc)}") from exc
        shape = tuple(x.shape[1:])
        specs.append(LayerSpec(name, fn, arrays, shape, int(sum(a.nbytes for a in arrays))))
    return specs


def run_layers(specs: Sequence[LayerSpec], params: Sequence[Sequence], x):
    """Apply ``specs`` in order, layer ``i`` with ``params[i]``."""
    for spec, p in zip(specs, params, strict=True):
        x = spec.fn(p, x)
    return x


def _grad_step(spec: LayerSpec, params: list, device: str):
    @tf.function(autograph=False)
    def step(x):
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(spec.fn(params, x))
        return tape.gradient(y, [x, *params])[0]
    return step


def layer_times(specs: Sequence[LayerSpec], input_shape: Sequence[int], batch: int,
                device: str = "/cpu:0", repeat: int = 5) -> list[float]:
    """Measured seconds of each layer's forward and backward pass on ``batch`` examples (for
    ``split(..., balance="time", times=...)``)."""
    checks.positive_int("batch", batch)
    device = parse_device(device).to_string()
    out, shape = [], tuple(input_shape)
    for spec in specs:
        with tf.device(device):
            params = [tf.Variable(a) for a in spec.arrays]
            x = tf.zeros((batch, *shape))

        step = _grad_step(spec, params, device)
        out.append(timing.time_fn(lambda s=step, x=x: s(x).numpy(), repeat=repeat))
        shape = spec.output_shape
    return out


def dense(params, x):
    """A ReLU layer: ``relu(x @ w + b)`` with ``params = [w, b]``."""
    return tf.nn.relu(tf.matmul(x, params[0]) + params[1])


def linear(params, x):
    """A linear layer: ``x @ w + b`` with ``params = [w, b]``."""
    return tf.matmul(x, params[0]) + params[1]


def mlp_layers(sizes: Sequence[int], seed: int = 0) -> list[tuple]:
    """``accel.models.mlp_init(sizes, seed)`` as ``(fn, [w, b])`` layers: ReLU between layers, a
    linear last layer, so running them equals ``accel.models.mlp_apply``."""
    arrays = models.mlp_init(list(sizes), seed)
    n = len(arrays) // 2
    return [(dense if i < n - 1 else linear, arrays[2 * i:2 * i + 2]) for i in range(n)]
