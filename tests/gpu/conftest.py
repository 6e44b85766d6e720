"""What the GPU checks share: ``run_on(count, body)`` runs ``body`` in a fresh process after
``names = devices.setup(count, kind=KIND)`` (TF32 off) and returns its stdout; every test here
is marked ``gpu`` and skipped without a GPU. ``ACCEL_GPU_CHECK_KIND=cpu`` runs them on logical
CPUs instead (a dry run of the tests themselves)."""

import os
import textwrap

import pytest
import tensorflow as tf

from accel.procs import run_python

KIND = os.environ.get("ACCEL_GPU_CHECK_KIND", "gpu")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="no GPU here (make gpu-check runs these where there is one)")
    absent = KIND == "gpu" and not tf.config.list_physical_devices("GPU")
    for item in items:
        if str(item.path).startswith(here) and absent:
            item.add_marker(skip)


def _run_on(count: int, body: str) -> str:
    head = textwrap.dedent(f"""
        import numpy as np
        import tensorflow as tf
        from accel import devices
        names = devices.setup({count}, kind={KIND!r})
        tf.config.experimental.enable_tensor_float_32_execution(False)
        assert all({KIND.upper()!r} in d for d in names), names
        rng = np.random.default_rng(0)
    """)
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    return run_python(head + textwrap.dedent(body), env=env, timeout=300)


@pytest.fixture
def run_on():
    """``run_on(count, body) -> stdout``; ``run_on.kind`` is ``"gpu"`` or ``"cpu"``."""
    _run_on.kind = KIND
    return _run_on
