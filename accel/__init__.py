"""accel: the helper package of the "Accelerating TensorFlow" course.

One module per idea; every chapter imports from here and so can your own code.

======================  ============================================================  =======
module                  idea                                                          chapter
======================  ============================================================  =======
``accel.devices``       device names, physical vs logical devices, ``setup()``         01
``accel.scale``         the scale of training: FLOPs of a run, measured matmul speed   01
``accel.placement``     which op ran where (``placement_of``), device functions,       02, 03
                        placement logging, soft placement
``accel.kernels``       the kernel registry: op x device type x dtype, portability     03
``accel.copy_cost``     what crossing devices costs: measured, and a bandwidth model   02
``accel.diagrams``      the figures of chapters 01-03                                  01-03
``accel.timing``        wall-clock medians and ratio tables                            all
``accel.data``          synthetic, learnable data sets                                 all
``accel.models``        a tiny MLP as plain variables and as a Keras model             all
``accel.viz``           generic plots and the ``make images`` registry                 all
``accel.bench``         the benchmarks behind ``python -m accel bench NAME``           all
======================  ============================================================  =======

Importing ``accel`` sets ``TF_CPP_MIN_LOG_LEVEL=2`` (unless you set it) *before* TensorFlow is
imported, because TensorFlow reads it only once, at import time.

Command line: ``python -m accel devices`` prints the device report; ``python -m accel bench NAME``
runs a benchmark (``python -m accel bench --list`` shows the names).
"""

from __future__ import annotations

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"
