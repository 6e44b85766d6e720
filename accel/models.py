"""Tiny models used across chapters: a plain-variables MLP (for hand-written parallelism) and
the same network as a Keras model (for strategies and ``fit``)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["mlp_init", "mlp_apply", "keras_mlp", "max_difference"]


def _check_sizes(sizes: list[int]) -> None:
    if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
        raise ValueError(f"sizes must list >= 2 positive layer widths, got {sizes!r}")


def mlp_init(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    """Glorot-uniform weights and zero biases as NumPy arrays ``[w0, b0, w1, b1, ...]``.

    NumPy (not variables) so each parallel variant can create its own copies on its own devices
    from identical starting values.
    """
    _check_sizes(sizes)
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        params.append(rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32))
        params.append(np.zeros((fan_out,), np.float32))
    return params


def mlp_apply(params, x):
    """Forward pass of the MLP: ReLU between layers, linear output."""
    if len(params) % 2:
        raise ValueError(f"params must alternate weight, bias; got {len(params)} tensors")
    h = x
    for i in range(0, len(params), 2):
        h = tf.matmul(h, params[i]) + params[i + 1]
        if i + 2 < len(params):
            h = tf.nn.relu(h)
    return h


def keras_mlp(sizes: list[int], seed: int = 0) -> tf.keras.Model:
    """The MLP of ``mlp_init(sizes, seed)`` as a Keras model with the same initial weights."""
    _check_sizes(sizes)
    inputs = tf.keras.Input((sizes[0],))
    h = inputs
    for j, width in enumerate(sizes[1:]):
        last = j == len(sizes) - 2
        h = tf.keras.layers.Dense(width, activation=None if last else "relu")(h)
    model = tf.keras.Model(inputs, h)
    model.set_weights(mlp_init(sizes, seed))
    return model


def max_difference(weights_a, weights_b) -> float:
    """The largest absolute element-wise difference between two lists of weights (arrays,
    tensors or variables, e.g. ``model.get_weights()`` and ``step.variables``), paired in order.
    The way chapters and tests say "these two trainings ended with the same weights"."""
    a = [np.asarray(w) for w in weights_a]
    b = [np.asarray(w) for w in weights_b]
    if len(a) != len(b):
        raise ValueError(f"the weight lists differ in length: {len(a)} vs {len(b)}")
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        if u.shape != v.shape:
            raise ValueError(f"weight {i}: shapes differ, {u.shape} vs {v.shape}")
    return max((float(np.max(np.abs(u - v))) for u, v in zip(a, b, strict=True) if u.size),
               default=0.0)
