"""Training on several devices of one process (chapter numbers in brackets).

- ``accel.parallel.parameter_server`` (06): a parameter server and worker threads: sync, async
  (under the server's lock, Downpour-style), lock-free (Hogwild), K-of-N, controlled delay;
- ``accel.parallel.hogwild`` (06): the lock-free workers, and lost updates counted;
- ``accel.parallel.staleness`` (06): the server's decision rules as pure functions, per-update
  records and their analysis;
- ``accel.parallel.data`` (07): data parallelism by hand, the towers recipe;
- ``accel.parallel.mirrored`` (07): the same training with ``MirroredStrategy``;
- ``accel.parallel.strategies`` (07, 14): default / one-device / mirrored / central-storage
  strategies by name (with their ``cross_device_ops``) and one custom loop that runs under each;
- ``accel.parallel.local_sgd`` (13): local SGD, the replicas' weights averaged every k steps;
- ``accel.parallel.inputs`` (08): TFRecord files read back through ``tf.data``, split per tower;
- ``accel.parallel.partition`` (09, 10): cutting a layer sequence into parts (pure functions);
- ``accel.parallel.layers`` (09, 10): a model as a list of layers, checked to chain;
- ``accel.parallel.model`` (09): model parallelism: a partition over devices, its training step
  (TF2 and TF1 forms), hybrid replicas x stages;
- ``accel.parallel.trace`` (09): what crossed between devices (bytes) and when each device was
  busy, from what TensorFlow executed;
- ``accel.parallel.keras_model`` (09-): the model contract every form shares: a Keras
  model's layers copied onto devices, the loss ``fit`` trains (``model.losses`` included),
  sparse gradients merged as slices;
- ``accel.parallel.form`` (07-15): ``Form``, the base of every Keras form (one device rule,
  the optimizer policy, ``fit`` with Keras's habits, ``train_step`` logs, ``write_back``);
- ``accel.parallel.forms``: every Keras form by name (``FORMS``, ``make_form``);
- ``accel.parallel.replicas`` (15): ``KerasReplicas``, a Keras model run by several devices on
  their shards, the base of ``Zero``, ``Offload`` and ``Accumulating``;
- ``accel.parallel.pipeline`` (10): pipeline schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1
  and ZB-V with the backward split into input-gradient and weight-gradient tasks) as plain data, no
  TensorFlow;
- ``accel.parallel.pipeline_exec`` (10): running any such schedule on TensorFlow devices;
  ``Pipeline``, a Keras ``Sequential`` trained that way;
- ``accel.parallel.megatron`` (11): tensor parallelism by hand: column- and row-parallel dense
  layers, Megatron's f and g, the MLP and a transformer block with its heads split, and with
  sequence parallelism (the activations between the regions split along the sequence);
- ``accel.parallel.context`` (11): context parallelism: attention over a sequence split across
  devices, by a ring of K/V blocks, an all-gather of K/V, or Ulysses's all-to-all over heads;
- ``accel.parallel.tensor`` (11): the same as Keras layers (``ColumnParallelDense``,
  ``RowParallelDense``, ``HeadParallelAttention``) and ``TensorParallel``, which converts a Keras
  model's layers by patterns on their paths;
- ``accel.parallel.mesh`` (11): the same with DTensor: meshes, layouts, the collectives it inserts;
- ``accel.parallel.vocab`` (11): the vocabulary split: embedding and softmax cross-entropy;
- ``accel.parallel.zero`` (15): ZeRO stages 0-3 (optimizer state, gradients, weights sharded):
  by hand with Adam, and ``Zero`` for a Keras model with a per-element Keras optimizer; the
  bytes each device holds counted from its variables;
- ``accel.parallel.offload`` (15): the optimizer's state and update on a host device (by hand,
  and ``Offload`` for a Keras model);
- ``accel.parallel.accumulate`` (15): gradient accumulation, k micro-steps then one update;
- ``accel.parallel.moe`` (16): a mixture of experts: the routing rule (pure), experts on
  several devices with an all-to-all each way, the load-balancing loss; ``MoE``, a Keras layer.
"""
