"""Part IV: TensorFlow clusters as real processes (chapter 10).

* ``accel.distributed.cluster``: cluster specs, ``TF_CONFIG``, free ports, ``LocalCluster`` (one
  ``tf.distribute.Server`` per task, each in its own process, always ended), ``ping``.
* ``accel.distributed.replication``: the four ways to replicate training (in-graph or
  between-graph x synchronous or asynchronous) as TF1 graphs on a cluster, and the TF2 strategies
  (``ParameterServerStrategy``, ``MultiWorkerMirroredStrategy``) on the same model.
"""
