"""The one way the package starts a fresh Python: some things (visible GPUs, thread pools, the
CPU allocator, logical devices) are fixed once TensorFlow has started, so showing them needs a
new process. Every child gets a timeout and is killed if it outlives it."""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["run_python", "ChildFailed"]


class ChildFailed(RuntimeError):
    """A child Python exited with an error or ran past its timeout."""


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120,
               quiet_tensorflow: bool = True) -> str:
    """Run ``code`` in a fresh interpreter and return its standard output.

    ``env`` is added to this process's environment (like a shell prefix); with
    ``quiet_tensorflow`` the child starts with ``TF_CPP_MIN_LOG_LEVEL=3`` unless ``env`` says
    otherwise. Raises ``ChildFailed`` with the end of the child's stderr if it exits non-zero,
    and after ``timeout`` seconds (the child is killed).
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string of Python source, got {type(code).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    full_env = {**os.environ, **({"TF_CPP_MIN_LOG_LEVEL": "3"} if quiet_tensorflow else {}),
                **(env or {})}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=full_env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ChildFailed(f"the child Python ran past its {timeout:g} s timeout and was "
                          "killed") from exc
    if proc.returncode != 0:
        raise ChildFailed(f"the child Python failed (exit {proc.returncode}):\n"
                          f"{proc.stderr[-3000:]}")
    return proc.stdout
