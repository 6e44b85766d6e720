"""Chapter 08's input-pipeline experiments: is a training step input-bound or compute-bound,
what does ``tf.data`` really run, and what competes for the cores?

* ``decode_map(delay_s, calls=None)``: a ``map`` function ``(x, y) -> (x, y)`` that takes
  ``delay_s`` seconds per batch (a ``tf.py_function`` that sleeps: a stand-in for reading from a
  slow disk; a sequence of delays for a cost that varies); ``calls`` counts how often it ran;
* ``compute_map(rounds, features)``: a decoder that computes instead (pure TensorFlow,
  stateless): it holds a core, as real decoding does;
* ``pipelines(x, y, batch_size, delay_s)``: the chapter's pipelines over ``decode_map`` (plain,
  prefetch, parallel map, cache), as the chapter's cell writes them;
* ``transformations(dataset)``: the dataset's graph as written, with each parallel map's
  ``num_parallel_calls``; ``iterator_chain(dataset)``: the chain ``tf.data`` really runs after
  its rewrites, read from a profiler trace;
* ``verdict(input_s, compute_s)``: the pure rule, "input-bound" when feeding a step takes longer
  than computing it;
* ``measure_input(pipelines, x, y, batch_size, device)``: seconds per step of the compute alone,
  the input alone, and training fed by each pipeline, every row with the same warm-up, timed in
  interleaved rounds; ``bench_input``: the same as a benchmark;
* ``read_shards(delay_s)``: an ``interleave`` function reading a TFRecord shard with a latency
  per read; ``time_passes(datasets)``: seconds per full pass, interleaved rounds;
* ``local_data_service(workers)``: a tf.data service (dispatcher and workers) in this process,
  always stopped;
* ``check_compute_bound``, ``check_cache_placement``, ``check_parallel_maps``: the exercises.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf

from accel import checks, datasets, models, timing
from accel.training import squared_error

__all__ = ["decode_map", "compute_map", "pipelines", "transformations", "iterator_chain",
           "verdict", "time_feeds", "measure_input", "bench_input", "read_shards", "time_passes",
           "local_data_service", "EXERCISE3_MAPS", "check_compute_bound",
           "check_cache_placement", "check_parallel_maps"]


def decode_map(delay_s: float | Sequence[float], calls: list | None = None) -> Callable:
    """A ``Dataset.map`` function ``(x, y) -> (x, y)`` whose ``x`` passes through a
    ``tf.py_function`` that sleeps ``delay_s`` seconds (per batch, if mapped after ``batch``);
    a sequence of delays is used in turn, call after call (a decoder whose cost varies, e.g. one
    slow read every few batches). Each run appends 1 to ``calls`` if given. Sleeping holds a
    ``tf.data`` thread but no core. ``tf.py_function`` is stateful, so ``tf.data`` never
    parallelizes this map by itself (``iterator_chain`` shows it)."""
    delays = [delay_s] if isinstance(delay_s, numbers.Real) else list(delay_s)
    if not delays:
        raise ValueError("delay_s is an empty sequence: give a delay in seconds")
    for d in delays:
        checks.non_negative_number("delay_s", d)
    counter = itertools.count()

    def work(xb):
        time.sleep(delays[next(counter) % len(delays)])
        if calls is not None:
            calls.append(1)
        return xb

    def decode(xb, yb):
        out = tf.py_function(work, [xb], xb.dtype)
        out.set_shape(xb.shape)
        return out, yb

    return decode


def compute_map(rounds: int, features: int, seed: int = 0) -> Callable:
    """A ``Dataset.map`` function ``(x, y) -> (z, y)`` that computes: ``rounds`` times
    ``z = tanh(z @ w)`` from ``z = x``, with a fixed ``[features, features]`` matrix ``w``
    (scaled so values stay in range). Pure TensorFlow and stateless (a ``tf.while_loop``), so it
    holds a core for as long as it runs and ``tf.data`` may parallelize it by itself."""
    checks.positive_int("rounds", rounds)
    checks.positive_int("features", features)
    w = tf.constant(np.random.default_rng(seed).standard_normal((features, features))
                    / np.sqrt(features), tf.float32)

    def decode(xb, yb):
        if xb.shape[-1] != features:
            raise ValueError(f"compute_map was built for {features} features, the batch has "
                             f"{xb.shape[-1]}")
        _, z = tf.while_loop(lambda i, z: i < rounds, lambda i, z: (i + 1, tf.tanh(z @ w)),
                             (tf.constant(0), xb))
        return z, yb

    return decode


def pipelines(x: np.ndarray, y: np.ndarray, batch_size: int, delay_s: float,
              parallel_calls: int = 4) -> dict[str, tf.data.Dataset]:
    """The chapter's pipelines over ``decode_map(delay_s)``: ``map`` (no prefetch at all: the
    prefetch ``tf.data`` injects by itself switched off), ``map + prefetch``, ``parallel map
    (<parallel_calls>) + prefetch`` and ``map + cache + prefetch``."""
    checks.positive_int("batch_size", batch_size)
    checks.positive_int("parallel_calls", parallel_calls)
    decode = decode_map(delay_s)
    base = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=True)
    no_prefetch = tf.data.Options()
    no_prefetch.experimental_optimization.inject_prefetch = False
    return {
        "map": base.map(decode).with_options(no_prefetch),
        "map + prefetch": base.map(decode).prefetch(tf.data.AUTOTUNE),
        f"parallel map ({parallel_calls}) + prefetch":
            base.map(decode, num_parallel_calls=parallel_calls).prefetch(tf.data.AUTOTUNE),
        "map + cache + prefetch": base.map(decode).cache().prefetch(tf.data.AUTOTUNE),
    }


def _graph_nodes(dataset: tf.data.Dataset) -> tuple[dict, object]:
    """The nodes of ``dataset``'s graph as written (name -> NodeDef) and its output node, read
    through ``Dataset._variant_tensor``, a private TensorFlow attribute: ``tf.data`` has no
    public way to export the graph as written."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(f"expected a tf.data.Dataset, got {type(dataset).__name__}")
    graph = tf.compat.v1.GraphDef.FromString(
        tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor).numpy())
    nodes = {n.name: n for n in graph.node}
    return nodes, nodes[next(n for n in graph.node if n.op == "_Retval").input[0]]


def transformations(dataset: tf.data.Dataset) -> list[tuple[str, int | None]]:
    """``(op, num_parallel_calls)`` for each dataset op of ``dataset``'s graph as written (before
    the rewrites ``tf.data`` applies when an iterator is made: ``iterator_chain`` shows those),
    from the source to the output, e.g. ``[("TensorSliceDataset", None), ("BatchDatasetV2",
    None), ("ParallelMapDatasetV2", 4), ("PrefetchDataset", None), ("OptionsDataset", None)]``
    (``-1`` is ``tf.data.AUTOTUNE``). Only the first input of each op is followed (the chain a
    linear pipeline is)."""
    nodes, node = _graph_nodes(dataset)
    chain = []
    while True:
        calls = None
        if node.op.startswith("ParallelMap"):
            data_inputs = [i for i in node.input if not i.startswith("^")]
            const = nodes[data_inputs[-1].split(":")[0]]
            calls = int(tf.make_ndarray(const.attr["value"].tensor))
        chain.append((node.op, calls))
        inputs = [i for i in node.input if not i.startswith("^")]
        if not inputs or nodes[inputs[0]].op == "Const":
            return chain[::-1]
        node = nodes[inputs[0].split(":")[0]]


def _unbounded_maps(dataset: tf.data.Dataset) -> bool:
    """Whether a parallel map of ``dataset`` was written with ``use_unbounded_threadpool=True``
    (its calls then run on threads of their own, not on the pool of one thread per core)."""
    nodes, _ = _graph_nodes(dataset)
    return any(n.op.startswith("ParallelMap") and n.attr["use_unbounded_threadpool"].b
               for n in nodes.values())


def iterator_chain(dataset: tf.data.Dataset, elements: int = 2) -> list[str]:
    """The transformations ``tf.data`` really runs for ``dataset``, from the output to the
    source, e.g. ``["Prefetch", "ParallelMapV2", "BatchV2", "TensorSlice"]``: the pipeline
    after the rewrites ``tf.data`` applies when an iterator is made (``tf.data.Options``:
    ``map_parallelization``, ``map_and_batch_fusion``, ``inject_prefetch``, ...).

    Read from a profile, the documented way ("Analyze tf.data performance with the TF
    Profiler": each iterator event has the long name ``Iterator::<Dataset_1>::...``): a fresh
    iterator yields ``elements`` elements under ``accel.profile.read_trace``, and the
    longest ``Iterator::Root::...`` event name of the trace is split at ``::``. For a linear
    pipeline that is the whole chain; for ``interleave`` and ``flat_map`` it is the outer
    pipeline (the datasets opened per input element, e.g. per file, are left out)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from accel import profile

    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(f"expected a tf.data.Dataset, got {type(dataset).__name__}")
    checks.positive_int("elements", elements)

    def read(path):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        return space

    try:
        space = profile.read_trace(lambda: [None for _ in itertools.islice(dataset, elements)],
                                   read)
    except tf.errors.AlreadyExistsError:
        raise RuntimeError("a profiler session is already running: stop it "
                           "(tf.profiler.experimental.stop()) first") from None
    names = [m.name.split("::")[2:] for plane in space.planes
             for m in plane.event_metadata.values()
             if m.name.startswith(("Iterator::Root::", "Iterator::Model::"))
             and "[" not in m.name]  # "Interleave[2]::...": the dataset of one input element
    if not names:
        raise RuntimeError("the profile holds no tf.data iterator events: did the dataset "
                           "yield any element?")
    return max(names, key=len)


def verdict(input_s: float, compute_s: float) -> str:
    """``"input-bound"`` if producing one batch (``input_s``) takes longer than one training
    step on data already in memory (``compute_s``), else ``"compute-bound"``."""
    checks.non_negative_number("input_s", input_s)
    checks.non_negative_number("compute_s", compute_s)
    return "input-bound" if input_s > compute_s else "compute-bound"


def time_feeds(feeds: dict[str, tuple[Callable[[], Iterable], Callable]], steps: int = 8,
               warmup: int = 2, rounds: int = 3) -> dict[str, float]:
    """Median seconds per step of each row of ``feeds`` (name -> ``(make_iterable, step)``:
    ``step(*element)`` runs once per element).

    Every row gets the same treatment: one untimed pass over a fresh iterable first (it traces
    the step and the map functions, fills caches), then ``rounds`` interleaved rounds, each
    with a fresh iterator made outside the timer, ``warmup`` untimed steps (the pipeline fills
    its buffers), ``steps`` timed steps (``timing.time_fn`` on the block), and the iterator
    released outside the timer before the next row starts: releasing a ``tf.data`` iterator
    sometimes takes over half a second (with autotuning on), and an iterator left alive keeps
    producing in the background, so the next row's own prefetch would fill up meanwhile.
    The result is the median of the rounds, per step."""
    checks.positive_int("steps", steps)
    checks.positive_int("rounds", rounds)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for make, step in feeds.values():
        for element in make():
            step(*element)
    samples: dict[str, list[float]] = {k: [] for k in feeds}
    for _ in range(rounds):
        for name, (make, step) in feeds.items():
            it = iter(make())
            for element in itertools.islice(it, warmup):
                step(*element)

            def block(it=it, step=step):
                for _ in range(steps):
                    step(*next(it))

            try:
                samples[name].append(timing.time_fn(block, repeat=1, warmup=0) / steps)
            except StopIteration:
                raise ValueError(f"{name!r} gives fewer than warmup + steps = "
                                 f"{warmup + steps} elements per pass") from None
            del block, it  # released now, before the next row's iterator exists
    return {k: float(statistics.median(v)) for k, v in samples.items()}


def measure_input(feeds: dict[str, tf.data.Dataset], x: np.ndarray, y: np.ndarray,
                  batch_size: int, device: str, hidden: Sequence[int] = (512, 512),
                  steps: int = 8, warmup: int = 2, rounds: int = 3,
                  alone: Sequence[str] | None = None) -> dict:
    """Seconds per step on ``device`` of an MLP (``hidden`` layers) trained with SGD:
    ``compute`` (on batches of ``x``, ``y`` already in memory), ``input alone`` (iterating the
    first pipeline of ``feeds``, no training) and each pipeline of ``feeds`` feeding the same
    step, all timed by ``time_feeds``. With ``alone`` (names of ``feeds``), those pipelines are
    timed without training instead, as rows ``"<name> alone"``, and the verdict is the first
    one's. Each pipeline must give at least ``warmup + steps`` batches per pass. Returns
    ``{"seconds": {...}, "verdict": ...}`` (input alone vs compute)."""
    if not feeds:
        raise ValueError("feeds is empty: give at least one pipeline")
    checks.positive_int("batch_size", batch_size)
    if alone is not None:
        alone = list(alone)
        unknown = [a for a in alone if a not in feeds]
        if not alone or unknown:
            raise ValueError(f"alone must name pipelines of feeds {sorted(feeds)}, got {alone}")
    with tf.device(device):
        model = models.keras_mlp([x.shape[-1], *hidden, y.shape[-1]])
    optimizer = tf.keras.optimizers.SGD(0.001)

    @tf.function(autograph=False)
    def train(xb, yb):
        with tf.device(device), tf.GradientTape() as tape:
            loss = tf.reduce_mean(squared_error(yb, model(xb, training=True)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_weights),
                                      model.trainable_weights, strict=True))
        return loss

    in_memory = list(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size,
                                                                      drop_remainder=True))
    rows = {"compute": (lambda: in_memory, train)}
    if alone is None:
        first = next(iter(feeds.values()))
        rows["input alone"] = (lambda: first, lambda xb, yb: None)
    else:
        rows.update({f"{name} alone": (lambda ds=feeds[name]: ds, lambda xb, yb: None)
                     for name in alone})
    rows.update({name: (lambda ds=ds: ds, train) for name, ds in feeds.items()})
    seconds = time_feeds(rows, steps, warmup, rounds)
    first_alone = "input alone" if alone is None else f"{alone[0]} alone"
    return {"seconds": seconds, "verdict": verdict(seconds[first_alone], seconds["compute"])}


def read_shards(delay_s: float, records_per_read: int = 32) -> Callable:
    """An ``interleave`` function: file name -> a ``tf.data.TFRecordDataset`` of that file
    whose elements are reads of ``records_per_read`` serialized records, each read taking
    ``delay_s`` seconds more (a sleeping ``tf.py_function``: the latency of remote storage,
    which holds a thread but no core)."""
    checks.non_negative_number("delay_s", delay_s)
    checks.positive_int("records_per_read", records_per_read)

    def wait(chunk):
        time.sleep(delay_s)
        return chunk

    def slow(chunk):
        out = tf.py_function(wait, [chunk], tf.string)
        out.set_shape(chunk.shape)
        return out

    def read(filename):
        return tf.data.TFRecordDataset(filename).batch(records_per_read).map(slow)

    return read


def time_passes(datasets: dict[str, tf.data.Dataset], rounds: int = 3) -> dict[str, float]:
    """Median seconds of one full pass over each dataset (no training): one untimed pass each,
    then ``rounds`` interleaved rounds (``timing.interleaved_medians``), so that drift of the
    machine hits every row alike."""
    if not datasets:
        raise ValueError("datasets is empty: give at least one")
    checks.positive_int("rounds", rounds)
    fns = {name: (lambda ds=ds: sum(1 for _ in ds)) for name, ds in datasets.items()}
    return timing.interleaved_medians(fns, rounds=rounds, repeat=1, warmup=1)


@contextlib.contextmanager
def local_data_service(workers: int = 2, timeout_s: float = 30.0):
    """A tf.data service in this process: one ``DispatchServer`` and ``workers``
    ``WorkerServer``s on free localhost ports (``accel.distributed.cluster.free_ports``).
    Yields the dispatcher's target (``grpc://localhost:PORT``) for
    ``tf.data.experimental.service.distribute(service=...)``; every server is stopped when the
    block ends, also on an error. (The servers have no public ``stop``: TensorFlow stops one
    when it is garbage-collected, ``server_lib.py``'s ``__del__`` -> ``_stop``, which is
    called here directly.) ``timeout_s`` bounds how long a worker waits for the dispatcher."""
    from accel.distributed.cluster import free_ports

    checks.positive_int("workers", workers)
    checks.positive_number("timeout_s", timeout_s)
    service = tf.data.experimental.service
    ports = free_ports(workers + 1)
    servers = []
    try:
        dispatcher = service.DispatchServer(service.DispatcherConfig(port=ports[0]))
        servers.append(dispatcher)
        address = dispatcher.target.split("://")[1]
        for port in ports[1:]:
            servers.append(service.WorkerServer(service.WorkerConfig(
                dispatcher_address=address, port=port,
                dispatcher_timeout_ms=int(timeout_s * 1000))))
        yield dispatcher.target
    finally:
        for server in reversed(servers):
            server._stop()


def bench_input(device_names: Sequence[str], quick: bool = False) -> dict:
    """The chapter's pipelines against compute alone on the first device: prints each row's
    step time as a ratio to the compute-only step, measured in this run, and the ceiling."""
    batch, delay, steps, warmup, rounds = (32, 0.005, 2, 1, 1) if quick else (256, 0.03, 8, 2, 3)
    x, y, _ = datasets.regression(batch * (steps + warmup), 64, seed=0)
    res = measure_input(pipelines(x, y, batch, delay), x, y, batch, device_names[0],
                        hidden=(64,) if quick else (512, 512), steps=steps, warmup=warmup,
                        rounds=rounds)
    seconds = res["seconds"]
    print(f"map sleeps {delay * 1e3:.0f} ms per batch of {batch}; median of {rounds} rounds of "
          f"{steps} steps after {warmup} warm-up steps")
    print(timing.format_ratios(seconds, "compute"))
    print("input alone vs compute alone:", res["verdict"])
    measured = timing.measure_ceiling()
    print(f"this run: {os.cpu_count()} cores")
    print(timing.ceiling_line(measured))
    out = {f"{k}/compute": v / seconds["compute"] for k, v in seconds.items()}
    out["ceiling"] = measured.value
    return out


def _effective_calls(chain: list[tuple[str, int | None]], pool: int,
                     unbounded: bool = False) -> int:
    """How many runs of the (first) map a pipeline has in flight at once: its
    ``num_parallel_calls`` (AUTOTUNE: as many as threads), at most ``pool`` threads unless
    the map has a thread pool of its own (``unbounded``)."""
    calls = next((c for op, c in chain if "Map" in op), None)
    if calls is None:
        return 1
    if calls == -1:
        return pool
    return calls if unbounded else min(calls, pool)


def check_compute_bound(answer, compute_s: float | None = None, delay_s: float = 0.03,
                        cores: int | None = None) -> str:
    """Exercise 1: a pipeline built from the chapter's ``base`` and ``decode`` (``delay_s`` per
    batch) whose input keeps up with a step of ``compute_s``, decoded afresh every epoch (no
    ``cache``). Read from its structure: ``k`` parallel calls run at most ``pool`` at a time,
    the dataset's ``private_threadpool_size`` or else this machine's ``cores`` (unless the map
    has ``use_unbounded_threadpool=True``: then all ``k``), so a batch is ready every
    ``delay_s / min(k, pool)``."""
    if answer is None or answer is ...:
        return "exercise 1: not answered yet (set answer1 to a dataset built from base and decode)"
    if not isinstance(answer, tf.data.Dataset):
        return f"exercise 1: answer1 should be a tf.data.Dataset, got {type(answer).__name__}"
    if compute_s is None:
        raise ValueError("compute_s is needed: the compute-alone time measured in section 2")
    checks.positive_number("compute_s", compute_s)
    chain = transformations(answer)
    ops = [op for op, _ in chain]
    if any(op.startswith("Cache") for op in ops):
        return ("exercise 1: not quite: cache() is not allowed here (every epoch must decode "
                "afresh, e.g. random augmentation)")
    cores = (os.cpu_count() or 1) if cores is None else checks.positive_int("cores", cores)
    pool = answer.options().threading.private_threadpool_size or cores
    k = _effective_calls(chain, pool, _unbounded_maps(answer))
    per_batch = delay_s / k
    if per_batch <= compute_s:
        return (f"exercise 1: correct: {k} decodes in flight give a batch every "
                f"{per_batch * 1e3:.1f} ms, within the {compute_s * 1e3:.1f} ms step")
    return (f"exercise 1: not quite: {k} decode(s) run at once (parallel calls, at most "
            f"{pool} threads in tf.data's pool), a batch every {per_batch * 1e3:.1f} ms > "
            f"{compute_s * 1e3:.1f} ms of compute")


def check_cache_placement(answer, batches: int = 4, epochs: int = 3) -> str:
    """Exercise 2: a function ``(base, decode, augment) -> dataset`` for which, over ``epochs``
    epochs of ``batches`` batches, ``decode`` runs once per batch and ``augment`` (random) once
    per batch and epoch, every batch delivered each epoch. Counted, not timed."""
    if answer is None or answer is ...:
        return ("exercise 2: not answered yet (set answer2 to a function "
                "(base, decode, augment) -> dataset)")
    if not callable(answer):
        return f"exercise 2: answer2 should be a function, got {type(answer).__name__}"
    x, y, _ = datasets.regression(8 * batches, 4, seed=0)
    base = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    decoded, augmented = [], []
    ds = answer(base, decode_map(0.0, decoded), decode_map(0.0, augmented))
    seen = [sum(1 for _ in ds) for _ in range(epochs)]
    if seen != [batches] * epochs:
        return f"exercise 2: not quite: the epochs gave {seen} batches, expected {batches} each"
    got = (len(decoded), len(augmented))
    if got == (batches, batches * epochs):
        return (f"exercise 2: correct: decode ran {got[0]} times (once per batch, then read from "
                f"the cache), augment {got[1]} times (every epoch)")
    return (f"exercise 2: not quite: over {epochs} epochs decode ran {got[0]} times and augment "
            f"{got[1]} (wanted {batches} and {batches * epochs})")


def _scale(xb, yb):
    return 2.0 * xb, yb


def _augment(xb, yb):
    return xb + tf.random.uniform(tf.shape(xb)), yb


def _seeded_augment(xb, yb):
    return xb + tf.random.stateless_uniform(tf.shape(xb), seed=[1, 2]), yb


def _logged(xb, yb):
    tf.print("decoded a batch of", tf.shape(xb)[0])
    return xb, yb


# exercise 3: four map functions; which of them does tf.data parallelize by itself?
EXERCISE3_MAPS: dict[str, Callable] = {"scale": _scale, "augment": _augment,
                                       "seeded augment": _seeded_augment, "logged": _logged}


def check_parallel_maps(answer) -> str:
    """Exercise 3: ``answer`` maps each name of ``EXERCISE3_MAPS`` to ``True`` (a plain
    ``base.map(f)`` runs in parallel: ``tf.data`` rewrote it) or ``False`` (it runs one call at
    a time). Checked against the chain each pipeline really runs (``iterator_chain``)."""
    if answer is None or answer is ...:
        return ("exercise 3: not answered yet (set answer3 to a dict: name -> True if tf.data "
                "runs that map in parallel)")
    if not isinstance(answer, dict) or set(answer) != set(EXERCISE3_MAPS) or not all(
            isinstance(v, bool) for v in answer.values()):
        return (f"exercise 3: answer3 should be a dict with the keys {list(EXERCISE3_MAPS)} "
                f"and True/False values, got {answer!r}")
    x, y, _ = datasets.regression(32, 4, seed=0)
    base = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    runs = {name: "ParallelMapV2" in iterator_chain(base.map(fn), elements=1)
            for name, fn in EXERCISE3_MAPS.items()}
    wrong = [name for name in EXERCISE3_MAPS if answer[name] != runs[name]]
    if not wrong:
        return ("exercise 3: correct: " + ", ".join(
            f"{name} {'parallel' if runs[name] else 'serial'}" for name in EXERCISE3_MAPS))
    return f"exercise 3: not quite: the trace disagrees with you on {wrong}"
