"""accel: the helper package of the "Accelerating TensorFlow" course.

One module per idea; every chapter imports from here and so can your own code.

=====================  =============================================================  =======
module                 idea                                                           chapter
=====================  =============================================================  =======
``accel.devices``      device names, physical vs logical devices, ``setup()``          01
``accel.placement``    which op ran where (``placement_of``), device functions,        02, 03
                       placement logging and soft placement, the kernel registry
``accel.timing``       small wall-clock timers and ratio reports                       all
``accel.viz``          the course's plots (device tables, placement, timings)          all
=====================  =============================================================  =======

Importing ``accel`` sets ``TF_CPP_MIN_LOG_LEVEL=2`` (unless you set it) *before* TensorFlow is
imported, because TensorFlow reads it only once, at import time.

Command line: ``python -m accel devices`` prints the device report; ``python -m accel bench NAME``
runs a benchmark (``python -m accel bench --list`` shows the names).
"""

from __future__ import annotations

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"
