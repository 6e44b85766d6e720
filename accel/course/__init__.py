"""The course's own experiments, on top of the library: benchmarks (``python -m accel bench``),
figures (``make images``) and the toy set-ups and demos the chapters run. This is the only part
of the package that calls ``accel.devices.setup()``; everything below it takes devices as
arguments.

Importing it sets the course's two TensorFlow settings, ``TF_CPP_MIN_LOG_LEVEL=2`` and
``TF_ENABLE_ONEDNN_OPTS=0`` (unless already set; ``accel``'s docstring says why), so it must be
imported before TensorFlow: every chapter's setup cell starts with ``import accel.course``.

``run_folder(name)``: a folder for files a chapter writes again at every run (XLA's dumps), one
per user under the system's temporary directory, emptied at each call, so runs do not pile up
(a notebook's kernel stopped by ``pytest --nbval`` runs no exit handler to clean up after it).
"""

import os as _os
import shutil as _shutil
import tempfile as _tempfile

# TensorFlow reads these once, at its own import: set them before anything imports it
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def run_folder(name: str) -> str:
    """The empty folder ``<temporary directory>/accel-<name>-<user id>``, made afresh: whatever
    the last run left in it is removed first."""
    if not name or _os.sep in name:
        raise ValueError(f"name={name!r}: give a non-empty folder name without {_os.sep!r}")
    path = _os.path.join(_tempfile.gettempdir(), f"accel-{name}-{_os.getuid()}")
    _shutil.rmtree(path, ignore_errors=True)
    _os.makedirs(path)
    return path
