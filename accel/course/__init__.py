"""The course's own experiments, on top of the library: benchmarks (``python -m accel bench``),
figures (``make images``) and the toy set-ups and demos the chapters run. This is the only part
of the package that calls ``accel.devices.setup()``; everything below it takes devices as
arguments.

Importing it sets the course's two TensorFlow settings, ``TF_CPP_MIN_LOG_LEVEL=2`` and
``TF_ENABLE_ONEDNN_OPTS=0`` (unless already set; ``accel``'s docstring says why), so it must be
imported before TensorFlow: every chapter's setup cell starts with ``import accel.course``.

``run_folder(name)``: a folder for files a chapter writes again at every run (XLA's dumps), one
per user and process under the system's temporary directory, emptied at each call, the folders
of ended processes removed, so runs do not pile up (a notebook's kernel stopped by
``pytest --nbval`` runs no exit handler to clean up after it).
"""

import os as _os
import shutil as _shutil
import stat as _stat
import tempfile as _tempfile

# TensorFlow reads these once, at its own import: set them before anything imports it
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def run_folder(name: str) -> str:
    """An empty folder ``<temporary directory>/accel-<name>-<user id>/<process id>``, made
    afresh: whatever it held is removed first, and so is everything else in its parent but the
    folders of running processes (two kernels running at once keep one folder each).
    ``ValueError`` if ``name`` is not one folder name, or if the parent folder is a link or
    not yours."""
    if not name or _os.sep in name:
        raise ValueError(f"name={name!r}: give a non-empty folder name without {_os.sep!r}")
    parent = _os.path.join(_tempfile.gettempdir(), f"accel-{name}-{_os.getuid()}")
    _os.makedirs(parent, mode=0o700, exist_ok=True)
    st = _os.lstat(parent)
    if _stat.S_ISLNK(st.st_mode) or st.st_uid != _os.getuid():
        raise ValueError(f"{parent} is a link or belongs to another user: remove it")
    for entry in _os.listdir(parent):  # all but the folders of running processes
        if not (entry.isdigit() and _alive(int(entry))):
            where = _os.path.join(parent, entry)
            if _os.path.isdir(where) and not _os.path.islink(where):
                _shutil.rmtree(where, ignore_errors=True)
            else:
                _os.remove(where)
    path = _os.path.join(parent, str(_os.getpid()))
    _shutil.rmtree(path, ignore_errors=True)
    _os.makedirs(path)
    return path


def _alive(pid: int) -> bool:
    try:
        _os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
