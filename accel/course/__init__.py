"""The course's own experiments, on top of the library: benchmarks (``python -m accel bench``),
figures (``make images``) and the toy set-ups and demos the chapters run. This is the only part
of the package that calls ``accel.devices.setup()``; everything below it takes devices as
arguments.

Importing it sets the course's two TensorFlow settings, ``TF_CPP_MIN_LOG_LEVEL=2`` and
``TF_ENABLE_ONEDNN_OPTS=0`` (unless already set; ``accel``'s docstring says why), so it must be
imported before TensorFlow: every chapter's setup cell starts with ``import accel.course``.
"""

import os as _os

# TensorFlow reads these once, at its own import: set them before anything imports it
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
