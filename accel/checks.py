"""Argument checks shared by the whole package: each raises ``ValueError`` naming the argument,
the value it got and what is allowed, before TensorFlow sees the value."""

from __future__ import annotations

import numbers
from collections.abc import Collection

__all__ = ["one_of", "positive_int", "non_negative_int", "positive_number",
           "non_negative_number", "learning_rate"]


def one_of(name: str, value, allowed: Collection) -> None:
    """``value`` must be one of ``allowed``."""
    if value not in allowed:
        listed = sorted(allowed) if all(isinstance(a, str) for a in allowed) else list(allowed)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value) -> int:
    """``value`` must be an int >= 1 (``True`` and ``2.0`` are refused); returns it as ``int``."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    """``value`` must be an int >= 0; returns it as ``int``."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_number(name: str, value) -> float:
    """``value`` must be a real number > 0 (NumPy scalars included); returns it as ``float``."""
    if not _is_real(value) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


def non_negative_number(name: str, value) -> float:
    """``value`` must be a real number >= 0; returns it as ``float``."""
    if not _is_real(value) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def learning_rate(value) -> float | None:
    """A learning rate (any real number > 0, NumPy scalars included) as ``float``; ``None`` if
    ``value`` is not a number (then it should be an optimizer). ``True`` is refused."""
    if isinstance(value, bool) or (_is_real(value) and not value > 0):
        raise ValueError(f"a learning rate must be a number > 0, got {value!r}")
    return float(value) if _is_real(value) else None
