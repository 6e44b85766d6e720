"""accel: the helper package of the "Accelerating TensorFlow" course.

One module per idea; every chapter imports from here and so can your own code.

module (chapter)                   idea
accel.devices (01)                 device names, physical vs logical devices, setup()
accel.scale (01)                   the scale of training: FLOPs of a run, measured matmul speed
accel.placement (02, 03)           where ops ran (placement_of), device functions, soft placement
accel.kernels (03)                 the kernel registry: op x device type x dtype, portability audit
accel.copy_cost (02)               what crossing devices costs: measured, and a bandwidth model
accel.diagrams (01-03)             the figures of chapters 01-03
accel.memory (04)                  training memory: estimated per part, and measured peaks
accel.memory_config (04)           TF1 ConfigProto / TF2 GPU memory plans, thread pools
accel.memory_measure (04)          what TensorFlow really holds: tape tensors, step peaks, scratch
accel.memory_savings (04)          recomputation and mixed precision, measured
accel.parameter_server (05)        parameter server + worker threads: sync, async, K-of-N, delay
accel.staleness (05)               per-update records, staleness analysis, the sync-async bench
accel.data_parallel (06)           towers by hand: split_batch, average_gradients, tower steps
accel.mirrored (06)                the same training with MirroredStrategy (custom loop)
accel.data_parallel_scaling (06)   scaling measured (towers vs Mirrored vs one device), cost model
accel.tfrecords (06)               examples to TFRecord files and back through tf.data
accel.timing (all)                 wall-clock medians and ratio tables
accel.data (all)                   synthetic, learnable data sets
accel.models (all)                 a tiny MLP as plain variables and as a Keras model
accel.viz (all)                    generic plots and the `make images` registry
accel.bench (all)                  the benchmarks behind `python -m accel bench NAME`

Importing ``accel`` sets two environment variables (unless you set them) *before* TensorFlow is
imported, because TensorFlow reads them only once, at import time:

* ``TF_CPP_MIN_LOG_LEVEL=2``: no C++ INFO/WARNING lines;
* ``TF_ENABLE_ONEDNN_OPTS=0``: TensorFlow's own CPU kernels everywhere. TensorFlow turns oneDNN on
  by default only on some CPUs (those with AVX-512 VNNI / BF16 or AMX); it then rewrites graphs
  (``MatMul`` runs as ``_MklMatMul``, ops are fused) and takes other scratch buffers, so placement
  tables and memory figures would depend on the reader's CPU. Set it to 1 yourself for speed.

Command line: ``python -m accel devices`` prints the device report; ``python -m accel bench NAME``
runs a benchmark (``python -m accel bench --list`` shows the names).
"""

from __future__ import annotations

import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

__version__ = "0.1.0"
