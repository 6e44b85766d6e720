"""Part IV: TensorFlow clusters as real processes (chapter 12).

* ``accel.distributed.cluster``: cluster specs, ``TF_CONFIG``, free ports, ``LocalCluster`` (one
  ``tf.distribute.Server`` per task, each in its own process, always ended), ``ping``.
* ``accel.distributed.replication``: the four ways to replicate training (in-graph or
  between-graph x synchronous or asynchronous) as TF1 graphs on a cluster.
* ``accel.distributed.shared``: variables and queues shared across sessions and processes,
  ``ByteSizeStrategy`` for ``replica_device_setter``, in-graph and between-graph ensembles.
* ``accel.distributed.tf2_runs``: ``ParameterServerStrategy`` + ``ClusterCoordinator`` and
  ``MultiWorkerMirroredStrategy`` on the same model, as processes, with custom loops.
* ``accel.distributed.strategies`` (chapter 14): ``MultiWorkerMirroredStrategy`` workers that
  report what they read (``InputContext``, each ``AutoShardPolicy``), checkpoint every k steps,
  and recover from a killed or frozen worker with exactly the uninterrupted run's weights.
"""
