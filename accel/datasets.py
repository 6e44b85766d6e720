"""Synthetic, learnable data sets (the course downloads nothing)."""

from __future__ import annotations

import numpy as np

__all__ = ["regression", "classification"]


def _check(n: int, features: int) -> None:
    if n < 1 or features < 1:
        raise ValueError(f"n and features must be >= 1, got n={n}, features={features}")


def regression(n: int = 1024, features: int = 8, outputs: int = 1, noise: float = 0.1,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, y, w_true)`` with ``y = x @ w_true + noise``; float32, reproducible from ``seed``."""
    _check(n, features)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal((features, outputs)).astype(np.float32)
    y = (x @ w + noise * rng.standard_normal((n, outputs))).astype(np.float32)
    return x, y, w


def classification(n: int = 1024, features: int = 16, classes: int = 4,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(x, labels)``: Gaussian blobs around ``classes`` random centres; int32 labels."""
    _check(n, features)
    if classes < 2:
        raise ValueError(f"classes must be >= 2, got {classes}")
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.standard_normal((classes, features))
    labels = rng.integers(0, classes, size=n).astype(np.int32)
    x = (centres[labels] + rng.standard_normal((n, features))).astype(np.float32)
    return x, labels
