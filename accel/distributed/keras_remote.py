"""The Keras forms across processes: the same code, with devices that belong to other tasks of a
TensorFlow cluster.

Every parallel form of ``accel.parallel`` takes device names. Name devices of a cluster's tasks
(``/job:worker/task:1/device:CPU:0``) in a process that has connected to that cluster
(``tf.config.experimental_connect_to_cluster``) and nothing else changes: the form creates its
variables under ``tf.device`` on those tasks, and TensorFlow's own runtime carries the tensors
between the processes (eager ops run remotely one by one; a ``tf.function`` is partitioned, one
part per task, with ``_Send`` / ``_Recv`` between them).

Connecting is process-wide and cannot be undone, so it belongs in a process of its own: never in
a notebook kernel or a test runner. Here:

* ``connect(cluster, timeout)`` (in the client process): checks that every task answers, then
  connects; its tasks' devices then appear in ``tf.config.list_logical_devices()``;
* ``check_cluster_devices(devices, cluster)``: ``ValueError`` naming a device of a task the
  cluster does not have, and the cluster's tasks (TensorFlow itself says only "unknown device",
  and only once an op runs there);
* ``check_reachable(cluster, timeout)``: ``ConnectionError`` naming every task whose address
  does not accept a connection within ``timeout`` seconds (connecting is lazy: without this check
  the first op on a dead task waits forever);
* ``fit_on_cluster(cluster, model, x, y, runs, loss=, optimizer=, batch_size=, epochs=)`` (in your
  own process): trains ``model`` with each form of ``runs`` (any form of
  ``accel.parallel.forms.FORMS``: towers, split and hybrid, the pipelines, tensor parallel,
  ZeRO 0-3, offload, accumulation; on the devices each run names) in **one** separate client
  process (``python -m accel.distributed.keras_remote SPEC``) that connects to the cluster.
  The model travels as a ``.keras`` file (``model.save``; a custom layer must be registered with
  ``keras.saving.register_keras_serializable`` in a module or ``.py`` file listed in
  ``imports``, which the client imports first), the data as
  ``.npz``; each run starts from the model's weights as given. The client takes the caller's
  ``keras.config.floatx()`` and global dtype policy (``keras.config.dtype_policy()``), set
  before it imports anything or rebuilds the model: a layer without a ``dtype`` (a sublayer a
  custom layer makes, the form's own layers) and Keras's losses compute there as they would
  here. (The cluster's tasks only run the ops the client places on them.) Returns one
  ``RemoteFit`` per run:
  the trained weights, the loss per epoch, where each working variable and optimizer slot lives,
  which ops each device ran (the placed graphs of the form's ``tf.function`` steps, from
  TensorFlow's run metadata) and, for a pipeline, each device's order of tasks. ``model`` itself
  is not changed: ``model.set_weights(result.weights)`` takes a run's result.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import keras
import numpy as np

from accel import checks
from accel.devices import parse_device
from accel.distributed.cluster import task_device
from accel.parallel import forms as registry
from accel.parallel.pipeline import device_orders
from accel.procs import report_and_linger, start_python, wait_for_reports

__all__ = ["FORMS", "cluster_tasks", "worker_devices", "check_cluster_devices",
           "check_reachable", "connect", "RemoteFit", "fit_on_cluster", "main"]

FORMS = tuple(registry.FORMS)  # every form of accel.parallel.forms


def _spec_of(cluster) -> dict[str, list[str]]:
    """The ``{job: [address, ...]}`` dict of a dict or a ``LocalCluster``."""
    spec = getattr(cluster, "cluster", cluster)
    if not isinstance(spec, Mapping) or not spec or not all(
            isinstance(a, list | tuple) and a for a in spec.values()):
        raise ValueError(f"cluster must be {{job: ['host:port', ...]}} or a LocalCluster, got "
                         f"{cluster!r}")
    return {str(job): list(addresses) for job, addresses in spec.items()}


def cluster_tasks(cluster) -> list[str]:
    """Every task of ``cluster`` as a device prefix: ``['/job:ps/task:0', '/job:worker/task:0',
    ...]``."""
    spec = _spec_of(cluster)
    return [task_device(job, i) for job in spec for i in range(len(spec[job]))]


def worker_devices(cluster, job: str = "worker", device_type: str = "CPU",
                   index: int = 0) -> list[str]:
    """One device per task of ``job``: ``['/job:worker/task:0/device:CPU:0', ...]``."""
    spec = _spec_of(cluster)
    if job not in spec:
        raise ValueError(f"job {job!r} is not in the cluster; its jobs: {sorted(spec)}")
    return [f"{task_device(job, i)}/device:{device_type}:{index}" for i in range(len(spec[job]))]


def check_cluster_devices(devices: Sequence[str], cluster) -> list[str]:
    """``devices`` in canonical spelling, each naming a task of ``cluster`` (a name without a
    job is the client's own device, ``/job:localhost`` too). ``ValueError`` naming the first
    device whose job or task the cluster does not have, and the cluster's tasks."""
    spec = _spec_of(cluster)
    out = []
    for name in devices:
        d = parse_device(name)
        if d.job not in (None, "localhost") and (
                d.job not in spec or (d.task or 0) >= len(spec[d.job])):
            raise ValueError(f"device {name!r} is on a task the cluster does not have; its "
                             f"tasks: {cluster_tasks(spec)}")
        out.append(d.to_string())
    return out


def check_reachable(cluster, timeout: float = 5.0) -> None:
    """``ConnectionError`` naming every task of ``cluster`` (and its address) that does not
    accept a TCP connection within ``timeout`` seconds."""
    checks.non_negative_number("timeout", timeout)
    spec = _spec_of(cluster)
    dead = []
    for job, addresses in spec.items():
        for i, address in enumerate(addresses):
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=timeout):
                    pass
            except (OSError, ValueError) as exc:
                dead.append(f"{job}:{i} at {address} ({type(exc).__name__})")
    if dead:
        raise ConnectionError(f"cannot connect to {', '.join(dead)} within {timeout:g} s: is "
                              "the cluster's server running there?")


def connect(cluster, timeout: float = 5.0) -> list[str]:
    """Connect this process to ``cluster`` (``tf.config.experimental_connect_to_cluster``: for
    the whole process, for good) after ``check_reachable``; returns the devices this process
    can now place work on, its own and the tasks'."""
    import tensorflow as tf

    spec = _spec_of(cluster)
    check_reachable(spec, timeout)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec))
    return [d.name for d in tf.config.list_logical_devices()]


@dataclass
class RemoteFit:
    """One run of ``fit_on_cluster``: the form, its devices and options, the trained weights
    (``model.get_weights()`` order), the loss of each epoch, ``(path, device)`` of each working
    variable and of each optimizer variable, ``{device: [op types]}`` of the placed graphs that
    ran (``tf.function`` steps; empty for a pipeline, whose stages run eagerly) and, for a
    pipeline, each device's ``(stage, microbatch, phase)`` order in the last step."""

    form: str
    devices: list[str]
    options: dict
    weights: list[np.ndarray]
    losses: list[float]
    variables: list[tuple[str, str]]
    slots: list[tuple[str, str]]
    op_devices: dict[str, list[str]] = field(default_factory=dict)
    device_orders: list[list[tuple]] = field(default_factory=list)


def _check_runs(runs: Sequence[Mapping], spec: dict) -> list[dict]:
    if not runs:
        raise ValueError("runs is empty: give one {'form': ..., 'devices': [...]} per run")
    out = []
    for run in runs:
        run = dict(run)
        form = run.pop("form", None)
        checks.one_of("form", form, FORMS)
        optimizer = run.pop("optimizer", None)
        devices = check_cluster_devices(run.pop("devices", None) or (), spec)
        unknown = sorted(set(run) - set(registry.FORMS[form].options))
        if unknown:
            raise ValueError(f"{form} run: unknown options {unknown}; it takes "
                             f"{list(registry.FORMS[form].options)}")
        if "replicas" in run:
            run["replicas"] = [check_cluster_devices(r, spec) for r in run["replicas"]]
        for key in ("variable_device", "host"):
            if key in run:
                run[key] = check_cluster_devices([run[key]], spec)[0]
        if not devices and "replicas" not in run:
            raise ValueError(f"{form} run: devices is empty")
        out.append({"form": form, "devices": devices, "options": run, "optimizer": optimizer})
    return out


def _serialize(obj, module) -> object:
    return obj if isinstance(obj, str) else module.serialize(obj)


def fit_on_cluster(cluster, model, x, y, runs: Sequence[Mapping], *, loss, optimizer,
                   batch_size: int, epochs: int = 1, imports: Sequence[str] = (),
                   timeout: float = 180.0, connect_timeout: float = 5.0) -> list[RemoteFit]:
    """Train ``model`` on ``x, y`` with each run of ``runs`` in one client process connected
    to ``cluster`` (a dict or a ``LocalCluster``), each run from ``model``'s current weights.

    A run is ``{"form": name, "devices": [...], **options}``, ``name`` a key of
    ``accel.parallel.forms.FORMS`` (``"data"``, ``"model"``, ``"pipeline"``, ``"tensor"``,
    ``"zero"``, ``"offload"``, ``"accumulate"``) with the form's own options (its class's
    ``options``: pipeline ``num_microbatches``, ``schedule``, ...; model ``balance`` or
    ``replicas`` instead of devices; zero ``stage``; offload ``host``; ...) and, optionally, its
    own ``optimizer``. The client builds it with ``accel.parallel.forms.make_form`` and reports
    through the form's public methods. ``loss`` and ``optimizer`` are Keras objects or names
    (each run gets a fresh optimizer from the config). The client trains with the form's
    ``fit`` in order (``shuffle=False``), in this process's ``keras.config.floatx()`` and
    dtype policy, writes back, and reports. ``model`` is not changed.

    Errors: ``ValueError`` for a device of a task the cluster lacks, ``ConnectionError`` for
    a task that does not answer within ``connect_timeout``, ``ChildFailed`` with the client's
    error or after ``timeout`` seconds."""
    spec = _spec_of(cluster)
    checked = _check_runs(runs, spec)
    for run in checked:  # a run's own optimizer, else the common one
        run["optimizer"] = _serialize(run["optimizer"] or optimizer, keras.optimizers)
    checks.positive_int("batch_size", batch_size)
    checks.positive_int("epochs", epochs)
    check_reachable(spec, connect_timeout)
    work = tempfile.mkdtemp(prefix="accel-keras-remote-")
    try:
        model.save(os.path.join(work, "model.keras"))
        np.savez(os.path.join(work, "data.npz"), x=np.asarray(x), y=np.asarray(y))
        request = {"cluster": spec, "runs": checked, "imports": list(imports),
                   "floatx": keras.config.floatx(),
                   "dtype_policy": keras.dtype_policies.serialize(keras.config.dtype_policy()),
                   "loss": _serialize(loss, keras.losses),
                   "batch_size": batch_size, "epochs": epochs, "work": work,
                   "connect_timeout": connect_timeout}
        path = os.path.join(work, "request.json")
        with open(path, "w") as f:
            json.dump(request, f)
        child = start_python(["-m", "accel.distributed.keras_remote", path],
                             name="the Keras client")
        try:
            (report,) = wait_for_reports([child], timeout)
        finally:
            child.stop()
        results = []
        for k, (run, rep) in enumerate(zip(checked, report["runs"], strict=True)):
            with np.load(os.path.join(work, f"run{k}.npz")) as f:
                weights = [f[f"w{i}"] for i in range(len(f.files))]
            results.append(RemoteFit(
                run["form"], run["devices"], run["options"], weights, rep["losses"],
                [tuple(v) for v in rep["variables"]], [tuple(v) for v in rep["slots"]],
                rep["op_devices"], [[tuple(t) for t in order] for order in rep["device_orders"]]))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ the client process
def _fit_one(request: dict, k: int, run: dict, x, y) -> dict:
    from tensorflow.python.eager import context

    model = keras.models.load_model(os.path.join(request["work"], "model.keras"), compile=False)
    optimizer = run["optimizer"]
    optimizer = keras.optimizers.get(optimizer) if isinstance(optimizer, str) else \
        keras.optimizers.deserialize(optimizer)
    loss = request["loss"]
    loss = loss if isinstance(loss, str) else keras.losses.deserialize(loss)
    form, devices, options = run["form"], run["devices"], run["options"]
    built = registry.make_form(form, model, devices or None, loss=loss, optimizer=optimizer,
                               **options)
    context.enable_run_metadata()
    try:  # in order, as the caller's data is given; fit writes back into model
        history = built.fit(x, y, batch_size=request["batch_size"], epochs=request["epochs"],
                            verbose=0, shuffle=False)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    orders = built.last_run.orders() if form == "pipeline" else []
    op_devices: dict[str, set] = {}
    for graph in metadata.function_graphs:
        for partition in graph.partition_graphs:
            for node in partition.node:
                op_devices.setdefault(node.device, set()).add(node.op)
    np.savez(os.path.join(request["work"], f"run{k}.npz"),
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    if form == "pipeline":
        expected = device_orders(built.schedule, len(built.devices), built.placement)
        if [list(map(tuple, o)) for o in orders] != expected:  # pragma: no cover - a bug
            raise RuntimeError(f"the pipeline ran {orders}, not its schedule's {expected}")
    return {"losses": [float(v) for v in history.history["loss"]],
            "variables": [_where(v) for v in built.working_variables()],
            "slots": [_where(v) for v in built.optimizer_variables()],
            "op_devices": {d: sorted(ops) for d, ops in op_devices.items() if d},
            "device_orders": [[list(t) for t in o] for o in orders]}


def _where(variable) -> tuple[str, str]:
    """``(path or name, device)`` of a Keras variable or a ``tf.Variable``."""
    if isinstance(variable, keras.Variable):
        return variable.path, variable.value.device
    return variable.name, variable.device


def _import(module: str) -> None:
    """Import a module by name, or a ``.py`` file by its path (as a module of its stem)."""
    if not module.endswith(".py"):
        importlib.import_module(module)
        return
    name = os.path.splitext(os.path.basename(module))[0]
    spec = importlib.util.spec_from_file_location(name, module)
    if spec is None or not os.path.exists(module):
        raise ValueError(f"imports: no Python file at {module!r}")
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])


def _client(request: dict) -> dict:
    keras.config.set_floatx(request["floatx"])  # the caller's, before any layer is made
    keras.config.set_dtype_policy(keras.dtype_policies.deserialize(request["dtype_policy"]))
    for module in request["imports"]:
        _import(module)
    start = time.perf_counter()
    devices = connect(request["cluster"], request["connect_timeout"])
    print(f"connected in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    with np.load(os.path.join(request["work"], "data.npz")) as f:
        x, y = f["x"], f["y"]
    runs = []
    for k, run in enumerate(request["runs"]):
        start = time.perf_counter()
        runs.append({**_fit_one(request, k, run, x, y), "seconds": time.perf_counter() - start})
    return {"devices": devices, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    """``python -m accel.distributed.keras_remote REQUEST.json``: the client process of
    ``fit_on_cluster`` (connects, trains, reports one JSON line, exits)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m accel.distributed.keras_remote REQUEST.json")
    with open(argv[0]) as f:
        request = json.load(f)
    report_and_linger(_client(request), limit=0.0)  # prints the report, then exits at once


if __name__ == "__main__":
    main()
