"""Cost models: every hardware figure with its source, and the arithmetic that turns figures into
times. Pure Python (no TensorFlow): a model answers "how long would this take on that hardware",
which the course's virtual devices cannot measure. Everything here is a MODEL and is labelled so
wherever a chapter prints it.

- ``accel.costmodel.hardware``: peak FLOP/s per precision and link bandwidths, each with its source,
  and what a committed measured record says a device reaches (``achievable``);
- ``accel.costmodel.record``: the hardware recorder (``python -m accel hardware-record``): matmul
  TFLOP/s per precision, device-memory and host-link bandwidth, measured with NumPy, CuPy or
  PyTorch (no TensorFlow), written as one JSON record;
- ``accel.costmodel.steps``: FLOPs of a training run, transfer times, the step time of synchronous
  data parallelism under three ways of exchanging gradients;
- ``accel.costmodel.model_parallel``: naive model parallelism of a model too big for one GPU
  (memory per GPU, step time, transfer time, idle share) over PCIe vs NVLink;
- ``accel.costmodel.pipeline``: a pipeline's step time and bubble, transformer activations;
- ``accel.costmodel.tensor_parallel``: when tensor parallelism pays (NVLink vs networks), bytes
  held and sent vs data parallelism, and the scaling Megatron-LM reports;
- ``accel.costmodel.planner``: a transformer on a cluster under a data x tensor x pipeline x
  ZeRO plan: memory per device and time per step;
- ``accel.costmodel.plans``: the planner's search: every plan, the ones that fit ranked, a clear
  error when none fits;
- ``accel.costmodel.megatron_table``: the planner against the layouts and throughputs Narayanan
  et al. 2021 report (Table 1);
- ``accel.costmodel.zero``: ZeRO's bytes per device (stages 0-3, mixed precision and float32
  Adam) and per step, and when optimizer offload over PCIe is free.
"""
