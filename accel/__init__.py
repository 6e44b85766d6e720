"""accel: the helper package of the "Accelerating TensorFlow" course.

The package is layered; a module imports only from its own layer or the ones above it in this
list (a test enforces it), so the library never depends on the course's experiments:

layer        module (chapter)                  idea
plumbing     accel.checks (all)                argument checks: ValueError naming the value
             accel.procs (all)                 the one runner of fresh Python processes, warm
                                               starts from a template that imported TF
             accel.timing (all)                medians, ratio tables, matmul speed, the ceiling
                                               (1-thread / 2-thread matmul time) of a run
             accel.datasets (all)              synthetic, learnable data sets
             accel.models (all)                a tiny MLP as plain variables and as a Keras model
             accel.training (all)              per-example losses, learning rate or optimizer
             accel.viz (all)                   generic plots: bars, curves, timelines
costmodel    accel.costmodel.hardware (01-)    peak FLOP/s and link bandwidths, with sources;
                                               what measured records say a device reaches
             accel.costmodel.record (01-)      the hardware recorder: achievable matmul, memory
                                               and host-link figures (NumPy / CuPy / PyTorch,
                                               no TensorFlow), one JSON record
             accel.costmodel.steps (01-07)     FLOPs of a run, copy times, data-parallel step time
             accel.costmodel.model_parallel    naive model parallelism on GPUs: step, idle (09)
             accel.costmodel.pipeline (10)     pipeline step, bubble, transformer activations
             accel.costmodel.transformer (09-16) a transformer layer's FLOPs and activation
                                               bytes (the planner's and the chapters' figures)
             accel.costmodel.tensor_parallel   when tensor parallelism pays; Megatron's scaling (11)
             accel.costmodel.collectives (13)  alpha-beta all-reduce model (separate links or one
                                               shared machine), bus bandwidth
             accel.costmodel.fit (13)          that model fitted to timings; measured crossovers
             accel.costmodel.zero (15)         ZeRO bytes held and sent per device; offload verdict
             accel.costmodel.planner (17)      memory per GPU and step time of a d x t x p plan
             accel.costmodel.plans (17)        every plan enumerated, the ones that fit ranked
             accel.costmodel.megatron_table    the planner vs Narayanan et al. 2021, Table 1 (17)
devices      accel.devices (01)                device names, physical vs logical devices, setup()
             accel.kernels (03)                the kernel registry: op x device type x dtype
             accel.placement (02, 03)          where ops ran (placement_of), device functions,
                                               soft placement, placement logs
             accel.profile (02)                what ran when: step-stats timelines, profiler
                                               traces as tables, C++ log levels
memory       accel.memory.estimate (04)        training memory estimated per part
             accel.memory.measure (04)         what TensorFlow holds: tape tensors, peaks, scratch
             accel.memory.config (04)          TF1 ConfigProto / TF2 GPU memory plans
             accel.memory.savings (04-05)      recomputation and mixed precision, measured
collectives  accel.collectives.base (11-15)   checks, one value per device, collective_op
             accel.collectives.direct (11-15) all-reduce, all-gather, reduce-scatter,
                                               all-to-all by hand, exact placed gradients
             accel.collectives.counting       bytes per device: formulas, and counted from
                                               the graph that ran (sent_bytes)
             accel.collectives.one_device (13) reduce, broadcast, all-reduce through one device
             accel.collectives.ring (13)      the ring all-reduce, its schedule as data
             accel.collectives.tree (13)      the tree all-reduce
             accel.collectives.halving_doubling recursive halving-doubling all-reduce (13)
             accel.collectives.packing (13)   buckets of small gradients, float16 compression
parallel     accel.parallel.staleness (06)     the server's decision rules, records, staleness
             accel.parallel.parameter_server   parameter server + worker threads (06)
             accel.parallel.hogwild (06)       lock-free workers: reads may mix versions
             accel.parallel.data (07)          data parallelism by hand: the towers recipe
             accel.parallel.mirrored (07)      the same with MirroredStrategy
             accel.parallel.strategies (14)    strategies by name, one custom loop for all
             accel.parallel.local_sgd (13)     replicas average their weights every k steps
             accel.parallel.inputs (08)        TFRecord files through tf.data, split per tower
             accel.parallel.partition (09-10)  cutting layers into balanced parts (pure)
             accel.parallel.keras_model (09-)  the model contract: a Keras model's layers
                                               copied onto devices; the loss fit trains
                                               (model.losses included); sparse gradients merged
             accel.parallel.form (07-15)       Form, the base of every Keras form: one device
                                               rule, optimizer policy, fit with Keras's habits,
                                               train_step logs, write_back
             accel.parallel.forms (07-15)      every Keras form by name (FORMS, make_form)
             accel.parallel.replicas (15)      KerasReplicas: a model run by several devices,
                                               each on its shard (Zero, Offload, Accumulating)
             accel.parallel.layers (09-10)     a model as a list of layers (fn, arrays) / Keras
             accel.parallel.model (09)         model parallelism: split, split step (TF2, TF1),
                                               hybrid replicas x stages
             accel.parallel.trace (09-)        bytes crossing devices; per-device busy time
             accel.parallel.pipeline (10)      GPipe / 1F1B / interleaved 1F1B / ZB-H1 / ZB-V
                                               (B and W split) schedules as data (pure, no TF)
             accel.parallel.pipeline_exec (10) running any schedule on devices, a thread a
                                               device; Pipeline: a Keras Sequential trained so
             accel.parallel.megatron (11)      tensor parallelism by hand: column/row-parallel
                                               dense, Megatron MLP and transformer block, with
                                               sequence parallelism
             accel.parallel.context (11)       context parallelism: ring, all-gather (Llama 3)
                                               and Ulysses attention over a split sequence
             accel.parallel.tensor (11)        the same as Keras layers; TensorParallel converts
                                               a Keras model's Dense / MultiHeadAttention by rules
             accel.parallel.mesh (11)          the same with DTensor: meshes, layouts, relayouts
             accel.parallel.vocab (11)         vocabulary-parallel embedding and cross-entropy
             accel.parallel.zero (15)          ZeRO stages 0-3: by hand (Adam) and Zero, a Keras
                                               model with a Keras optimizer; bytes held counted
             accel.parallel.offload (15)       the optimizer's state and update on a host device
             accel.parallel.accumulate (15)    gradient accumulation: k micro-steps, one update
             accel.parallel.moe (16)           mixture of experts: routing rules, all-to-all layer
distributed  accel.distributed.cluster (12)    cluster specs, TF_CONFIG, LocalCluster: one server
                                               process per task, always ended, clear errors
             accel.distributed.replication     in-graph / between-graph x sync / async (TF1,
                                               SyncReplicasOptimizer) on a cluster (12)
             accel.distributed.shared (12)     state shared across sessions and processes,
                                               variables on ps tasks by bytes, ensembles
             accel.distributed.tf2_runs (12)   ParameterServerStrategy + ClusterCoordinator and
                                               MultiWorkerMirroredStrategy as processes
             accel.distributed.keras_remote    every Keras form across processes: a client
                                               connected to a cluster (fit_on_cluster)
             accel.distributed.strategies (14) MultiWorkerMirroredStrategy workers: what each
                                               reads (InputContext, AutoShardPolicy), checkpoints,
                                               a killed or frozen worker and the restart
course       accel.course.registry             benchmarks (python -m accel bench) and figures
             accel.course.* (01-16)           each chapter's experiments, figures and toy set-ups;
                                               the only code that calls accel.devices.setup()

Importing ``accel`` or any library module changes nothing global: no environment variable,
no device configuration, no output. The course's settings belong to ``accel.course``, whose
import sets two environment variables (unless you set them) and must therefore come *before*
TensorFlow is imported, since TensorFlow reads them only once, at its own import (every
chapter's setup cell starts with ``import accel.course``; so do the command line and the
benchmarks, and worker processes inherit them):

* ``TF_CPP_MIN_LOG_LEVEL=2``: no C++ INFO/WARNING lines;
* ``TF_ENABLE_ONEDNN_OPTS=0``: TensorFlow's own CPU kernels everywhere. TensorFlow turns oneDNN on
  by default in its x86 Windows builds and on Linux CPUs with AVX-512 VNNI / BF16, AVX-VNNI or
  AMX, or ARM Neoverse V1 (``DefaultOneDnnPolicy``, tensorflow/core/util/port.cc); it then
  rewrites graphs (``MatMul`` runs as ``_MklMatMul``) and takes other scratch buffers, so
  placement tables and memory figures would depend on the reader's CPU.

Command line: ``python -m accel devices`` prints the device report; ``python -m accel bench NAME``
runs a benchmark (``python -m accel bench --list`` shows the names); ``python -m accel images``
redraws the figures.
"""

from __future__ import annotations

__version__ = "0.1.0"
