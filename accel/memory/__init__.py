"""Part II of the course (chapter 04): where training memory goes and how to configure it.

- ``accel.memory.estimate``: weights, gradients, optimizer slots, activations estimated from shapes;
- ``accel.memory.measure``: what TensorFlow really holds (tape tensors, allocator peaks, scratch);
- ``accel.memory.config``: TF1 ``ConfigProto`` and TF2 GPU memory plans, built from checked values
  (GPU options and the TF1 inter-op pool act once per process);
- ``accel.memory.savings``: recomputation and mixed precision, measured as ``tf.function`` steps.
"""
