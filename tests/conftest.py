"""Unit tests share one process, so they share one device configuration: 4 logical CPUs
(or GPUs where there are some). Tests that need another configuration start a fresh Python
with ``accel.procs.run_python``."""

import os

import pytest

# The BFC allocator makes tf.config.experimental.get_memory_info work on CPU; it must be chosen
# before TensorFlow starts (see accel.memory.estimate).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from accel import devices  # noqa: E402  (the variable above must be set first)

DEVICES = devices.setup(4)


@pytest.fixture(scope="session")
def four_devices() -> list[str]:
    """The names of the 4 devices every test process works on."""
    return list(DEVICES)
