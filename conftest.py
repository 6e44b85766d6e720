"""Project-wide pytest hooks: how nbval compares the chapters."""

import os

# Same mode as `make execute`: ipykernel does not forward C-level output under pytest.
os.environ.setdefault("PYTEST_CURRENT_TEST", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_collectstart(collector):
    """stderr (TensorFlow's C++ log lines, CUDA probing) is not part of a chapter's result."""
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)
