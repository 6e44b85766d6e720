"""Project-wide pytest hooks: how nbval compares the chapters, and what keeps the pytest-xdist
workers (``make test`` runs three) out of each other's way and busy to the end."""

import os

# Same mode as `make execute`: ipykernel does not forward C-level output under pytest.
os.environ.setdefault("PYTEST_CURRENT_TEST", "1")
# The course's TensorFlow settings (accel.course sets them in the chapters; library tests do not
# import it): quiet C++ logs, and TensorFlow's own CPU kernels on every CPU (no oneDNN rewrites).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

# Each xdist worker (gw0, gw1, ...) and everything it starts (cluster processes, notebook
# kernels) picks TCP ports from its own range, so no two workers choose the same free port
# between choosing and binding it (accel.distributed.cluster.free_ports). The ranges lie below
# Linux's ephemeral ports (32768+), which the OS hands to outgoing connections.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and _worker[2:].isdigit():
    _base = 20000 + 1500 * int(_worker[2:])
    os.environ.setdefault("ACCEL_PORT_RANGE", f"{_base}-{_base + 1499}")

def pytest_collectstart(collector):
    """stderr (TensorFlow's C++ log lines, CUDA probing) is not part of a chapter's result."""
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)

def pytest_collection_modifyitems(config, items):
    """For ``pytest -n 3 --dist loadfile`` (a file's tests, a notebook's cells, stay on one
    worker, in order): files holding multi-process tests, and notebooks, go first, so the long
    ones start early and short ones fill in at the end. (``--dist loadgroup`` would allow
    groups across files, but pytest-xdist 3.8 stops grouping under pytest 9.2's node ids:
    pytest-dev/pytest-xdist#1386.)"""

    def file_of(item):
        return item.nodeid.split("::")[0]

    long_files = {file_of(i) for i in items
                  if i.get_closest_marker("slow") or file_of(i).endswith(".ipynb")}
    order = {id(item): k for k, item in enumerate(items)}
    items.sort(key=lambda i: (file_of(i) not in HEAVIEST, file_of(i) not in long_files,
                              order[id(i)]))


# The two longest files (about 70 s and 45 s of work, `--durations`), ahead of every chapter: a
# minute-long file started last would leave the other worker idle at the end.
HEAVIEST = ("tests/course/test_cli.py", "tests/distributed/test_strategies.py")
