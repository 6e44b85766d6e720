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


def toy_problem(n: int = 96, features: int = 4, hidden: int = 8, seed: int = 0) -> dict:
    """A small learnable regression task and MLP as ``parameter_server.train`` arguments:
    ``model_fn``, ``loss_fn``, ``params`` (NumPy), ``x``, ``y``."""
    from accel import datasets, models
    from accel.training import squared_error

    x, y, _ = datasets.regression(n=n, features=features, seed=seed)
    return {"model_fn": models.mlp_apply, "loss_fn": squared_error,
            "params": models.mlp_init([features, hidden, 1], seed=seed), "x": x, "y": y}


@pytest.fixture(scope="module")
def problem() -> dict:
    """``toy_problem()``: 96 examples, 4 features, an MLP with 8 hidden units."""
    return toy_problem()
