"""Unit tests share one process, so they share one device configuration: 4 logical CPUs
(or GPUs where there are some). Tests that need another configuration run a subprocess."""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The BFC allocator makes tf.config.experimental.get_memory_info work on CPU (see accel.memory).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from accel import devices  # noqa: E402

DEVICES = devices.setup(4)


@pytest.fixture(scope="session")
def four_devices() -> list[str]:
    """The names of the 4 devices every test process works on."""
    return list(DEVICES)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter (its own TensorFlow start-up); return its stdout.

    Raises AssertionError with the child's stderr if it fails.
    """
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout
