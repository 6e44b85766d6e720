"""Placement: which op ran on which device, and the knobs that decide it.

- ``placement_of(fn, *args)`` / ``placement_of(fetches, session=sess)``: run something once and
  return the *actual* op -> device table (from the partition graphs TensorFlow executed, so the
  ``_Send`` / ``_Recv`` pairs of every copy between devices are in it too), and every tensor
  sent between devices as a ``Transfer`` (``sends_in``, the package's one reader of ``_Send`` and
  ``_HostSend`` nodes: ``accel.parallel.trace`` and ``accel.collectives.sent_bytes`` count from
  it).
- ``session_config(...)``: a TF1 ``ConfigProto`` that sees the same devices as eager TensorFlow.
- ``log_placement()``: capture TensorFlow's placement log (C-level output) as a table.
- ``soft_placement(enabled)``: switch TF2 soft placement for a block, restored on exit.
- ``by_op_type`` / ``variables_on``: device functions for ``tf.compat.v1.device(fn)``.

Which op *can* run where (the kernel registry) is ``accel.kernels``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import tensorflow as tf
from tensorflow.python.eager import context

from accel.devices import parse_device

__all__ = [
    "OpPlacement", "Transfer", "sends_in", "Placement", "placement_of", "session_config",
    "log_placement", "soft_placement", "by_op_type", "variables_on", "short_error", "short_device",
]


@dataclass(frozen=True)
class OpPlacement:
    """One executed op: its name, type, the device it ran on and the device it asked for."""

    name: str
    op_type: str
    device: str  # short form, e.g. '/device:CPU:2' ('/job:worker/task:1/device:CPU:0' remote)
    requested: str = ""  # what tf.device asked for ('' = no request)


def short_device(full: str) -> str:
    """Drop the ``/job:localhost/replica:0/task:0`` prefix of a local device name."""
    return re.sub(r"^/job:localhost/replica:0/task:0", "", full) or full


BACKWARD_MARKS = ("gradient", "backward")


@dataclass(frozen=True)
class Transfer:
    """One tensor sent between devices in one run (a ``_Send`` or ``_HostSend`` node of a
    partition graph)."""

    tensor: str  # the producing op's output, e.g. 'part_0/Relu:0'
    source: str
    target: str
    shape: tuple[int, ...] | None  # None where the static shape is not known
    dtype: str
    nbytes: int  # 0 where the shape is not known, and for control edges
    control: bool = False  # only carries a control edge (an empty dummy tensor)
    edge: str = ""  # TensorFlow's name for the send/receive pair, e.g. 'edge_8_x'

    @property
    def direction(self) -> str:
        """'backward' for a tensor made by a gradient op (its name holds ``gradient`` or
        ``backward``), else 'forward'."""
        return "backward" if any(w in self.tensor for w in BACKWARD_MARKS) else "forward"


def _graph_tensor(graph, name: str):
    op_name, _, slot = name.partition(":")
    try:
        return graph.get_operation_by_name(op_name).outputs[int(slot or 0)]
    except (KeyError, IndexError, ValueError):
        return None


SEND_OPS = ("_Send", "_HostSend")


def sends_in(graph_defs, graph=None) -> list[Transfer]:
    """Every send node of the partition ``graph_defs`` that ran, as a ``Transfer``: ``_Send``, and
    ``_HostSend``, which the partitioner uses where the sent tensor sits in host memory on a
    non-CPU device (an int32 on a GPU, say); shapes (and so bytes) come from ``graph``, the graph
    that was traced, where given."""
    out = []
    for gd in graph_defs:
        for node in gd.node:
            if node.op not in SEND_OPS:
                continue
            source = short_device(node.attr["send_device"].s.decode())
            target = short_device(node.attr["recv_device"].s.decode())
            edge = node.attr["tensor_name"].s.decode()
            name = node.input[0] if node.input else edge
            if "/ctrl/" in name or name.startswith("^"):
                out.append(Transfer(name.split("/ctrl/")[0].lstrip("^"), source, target, (),
                                    "control", 0, control=True, edge=edge))
                continue
            t = _graph_tensor(graph, name) if graph is not None else None
            dtype = tf.as_dtype(node.attr["T"].type)
            shape = tuple(t.shape.as_list()) if t is not None and t.shape.is_fully_defined() \
                else None
            size = dtype.size
            for dim in shape or ():
                size *= dim
            out.append(Transfer(name if ":" in name else name + ":0", source, target, shape,
                                dtype.name, size if shape is not None else 0, edge=edge))
    return out


@dataclass
class Placement:
    """The op -> device table of one run. ``result`` holds what the run returned; ``sends`` the
    tensors sent between devices (``Transfer``)."""

    rows: list[OpPlacement]
    result: object = None
    sends: list[Transfer] = field(default_factory=list)
    graphs: list = field(default_factory=list, repr=False)  # the partition GraphDefs that ran
    traced: object = field(default=None, repr=False)  # the traced graph (tf.Graph) that ran

    @property
    def transfers(self) -> list[tuple[str, str, str]]:
        """``(edge, from, to)`` of every send between devices, control edges included."""
        return [(t.edge, t.source, t.target) for t in self.sends]

    def __iter__(self) -> Iterator[OpPlacement]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def devices(self) -> list[str]:
        """Sorted devices that ran at least one op."""
        return sorted({r.device for r in self.rows})

    def ops_on(self, device: str) -> list[OpPlacement]:
        """The ops that ran on ``device`` (any spelling: '/cpu:1' == '/device:CPU:1')."""
        want = parse_device(device).to_string()
        return [r for r in self.rows if parse_device(r.device).to_string() == want]

    def device_of(self, name: str) -> str:
        """The device of the op called ``name``; ``KeyError`` lists the names if it is absent."""
        for r in self.rows:
            if r.name == name:
                return r.device
        raise KeyError(f"no op named {name!r}; ops: {sorted(r.name for r in self.rows)}")

    def counts(self) -> dict[str, int]:
        """Number of ops per device."""
        return {d: len(self.ops_on(d)) for d in self.devices()}

    def count_table(self, op_types: Sequence[str]) -> str:
        """How many ops of each of ``op_types`` ran on each device, as aligned text."""
        if not op_types:
            raise ValueError("op_types is empty: name the op types to count, e.g. ['MatMul']")
        widths = [max(6, len(t) + 2) for t in op_types]
        dev_width = max(8, *(len(d) + 2 for d in self.devices()))
        lines = [f"{'device':{dev_width}}"
                 + "".join(f"{t:>{w}}" for t, w in zip(op_types, widths, strict=True))]
        for dev in self.devices():
            n = Counter(r.op_type for r in self.ops_on(dev))
            lines.append(f"{dev:{dev_width}}"
                         + "".join(f"{n[t]:>{w}}" for t, w in zip(op_types, widths, strict=True)))
        return "\n".join(lines)

    def without(self, *op_types: str) -> Placement:
        """A copy without ops of the given types (e.g. '_Arg', '_Retval', 'NoOp')."""
        return Placement([r for r in self.rows if r.op_type not in op_types], self.result,
                         self.sends, self.graphs, self.traced)

    def format(self, requested: bool = False) -> str:
        """Aligned text, sorted by device then op name."""
        rows = sorted(self.rows, key=lambda r: (r.device, r.name))
        head = ["op", "type", "device"] + (["requested"] if requested else [])
        body = [[r.name, r.op_type, r.device] + ([r.requested or "-"] if requested else [])
                for r in rows]
        widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
        return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
                         for line in [head, *body])


def _from_graph_defs(graph_defs, requested: Mapping[str, str], result, graph) -> Placement:
    rows = [OpPlacement(node.name, node.op, short_device(node.device),
                        short_device(requested.get(node.name, "")))
            for gd in graph_defs for node in gd.node]
    return Placement(rows, result, sends_in(graph_defs, graph), list(graph_defs), graph)


def placement_of(target, *args, session=None, feed_dict=None, **kwargs) -> Placement:
    """Run ``target`` once and return where each of its ops actually ran.

    * TF2: ``target`` is a ``tf.function`` (a fresh copy with the same options, such as
      ``jit_compile`` and ``input_signature``, is run, because run metadata is only recorded when
      a function is first instantiated) or a plain callable (wrapped in ``tf.function``); it is
      called as ``target(*args, **kwargs)``.
    * TF1: pass ``session=sess``; ``target`` is anything ``sess.run`` accepts.

    Rows come from the partition graphs TensorFlow executed: after graph optimisation, so an op
    that was folded away is absent, and every cross-device edge shows as a ``_Send``/``_Recv``.
    A ``jit_compile=True`` function runs as one XLA program and leaves no partition graph: its
    table is empty (inspect it without ``jit_compile``).
    """
    if session is not None:
        if args or kwargs:
            raise ValueError("with session=..., pass feeds as feed_dict, not positional/keyword "
                             f"arguments (got {len(args)} args, keys {sorted(kwargs)})")
        opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
        meta = tf.compat.v1.RunMetadata()
        result = session.run(target, feed_dict=feed_dict, options=opts, run_metadata=meta)
        requested = {op.name: op.device for op in session.graph.get_operations()}
        return _from_graph_defs(meta.partition_graphs, requested, result, session.graph)
    if not callable(target):
        raise ValueError(f"target must be a callable or tf.function (or pass session=), "
                         f"got {type(target).__name__}")
    # run metadata is recorded when a function is first instantiated: run a fresh copy, with the
    # options of the given tf.function (jit_compile, input_signature, ...) if it is one
    fresh = target._clone(None) if hasattr(target, "_clone") else tf.function(target)  # noqa: SLF001
    concrete = fresh.get_concrete_function(*args, **kwargs)
    requested = {op.name: op.device for op in concrete.graph.get_operations()}
    context.enable_run_metadata()
    try:
        context.export_run_metadata()  # drop graphs recorded since an earlier run (eager ops)
        result = fresh(*args, **kwargs)
        meta = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    graphs = [pg for fg in meta.function_graphs for pg in fg.partition_graphs]
    return _from_graph_defs(graphs, requested, result, concrete.graph)


def session_config(**fields) -> tf.compat.v1.ConfigProto:
    """A TF1 ``ConfigProto`` starting from the eager context's (so a session sees the same logical
    devices ``accel.devices.setup`` made) with ``fields`` set, e.g.
    ``session_config(log_device_placement=True, allow_soft_placement=False)``."""
    config = tf.compat.v1.ConfigProto()
    config.CopyFrom(context.context().config)
    for name, value in fields.items():
        if not hasattr(config, name):
            raise ValueError(f"ConfigProto has no field {name!r}")
        setattr(config, name, value)
    return config


_LOG_LINE = re.compile(r"^(?P<name>[^\s:][^:]*): \((?P<type>\w+)\): (?P<device>/\S+)$")
_EAGER_LINE = re.compile(r"Executing op (?P<type>\w+) in device (?P<device>/\S+)")


@dataclass
class PlacementLog:
    """What TensorFlow's placement log printed inside a ``log_placement()`` block."""

    text: str = ""
    rows: list[OpPlacement] = field(default_factory=list)

    def format(self) -> str:
        return Placement(self.rows).format()


@contextlib.contextmanager
def log_placement() -> Iterator[PlacementLog]:
    """Capture TensorFlow's placement log (written by C code to fd 1/2) and parse it into rows.

    TF1 sessions log when created with ``session_config(log_device_placement=True)``. TF2's
    switch (``tf.debugging.set_log_device_placement``) only takes effect if set before the eager
    context starts: until then its setter only stores the value, which ``Context.config`` copies
    into the ``ConfigProto`` the context starts with (``tensorflow/python/eager/context.py``). The
    context starts at the first op and at anything that lists or configures logical devices
    (``tf.config.list_logical_devices()``, ``accel.devices.setup``); set later, the switch logs
    nothing in TF 2.21. So it is switched on (and back off on exit) only while the context has not
    started. Toggling it on a running context can also silently disable eager soft placement in
    TF 2.21 (while ``tf.config.get_soft_device_placement()`` still says True), so the
    soft-placement setting is re-applied on exit.
    """
    log = PlacementLog()
    previous = tf.debugging.get_log_device_placement()
    soft = tf.config.get_soft_device_placement()
    started = context.context()._context_handle is not None  # noqa: SLF001
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as tmp:
        try:
            os.dup2(tmp.fileno(), 1)
            os.dup2(tmp.fileno(), 2)
            if not started:
                tf.debugging.set_log_device_placement(True)
            yield log
        finally:
            if not started:
                tf.debugging.set_log_device_placement(previous)
                tf.config.set_soft_device_placement(soft)
            libc.fflush(None)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            tmp.seek(0)
            log.text = tmp.read().decode(errors="replace")
    for line in log.text.splitlines():
        if m := _LOG_LINE.match(line.strip()):
            log.rows.append(OpPlacement(m["name"], m["type"], short_device(m["device"])))
        elif m := _EAGER_LINE.search(line):
            log.rows.append(OpPlacement(m["type"], m["type"], short_device(m["device"])))


@contextlib.contextmanager
def soft_placement(enabled: bool) -> Iterator[None]:
    """TF2 soft placement on/off for a block (``tf.config.set_soft_device_placement``); the
    previous setting is restored on exit, also when the block raises."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, got {enabled!r}")
    previous = tf.config.get_soft_device_placement()
    tf.config.set_soft_device_placement(enabled)
    try:
        yield
    finally:
        tf.config.set_soft_device_placement(previous)


def by_op_type(mapping: Mapping[str, str], default: str) -> Callable:
    """A device function: ops whose type is in ``mapping`` go to ``mapping[type]``, others to
    ``default``. Use it with ``tf.compat.v1.device(fn)`` (plain ``tf.device`` rejects functions)."""
    for device in [*mapping.values(), default]:
        parse_device(device)  # validate early: a bad name is a ValueError here, not at run time

    def choose(op) -> str:
        return mapping.get(op.type, default)

    return choose


VARIABLE_OP_TYPES = ("VariableV2", "VarHandleOp", "Variable")


def variables_on(variable_device: str, other_device: str) -> Callable:
    """The classic device function: variables on ``variable_device``, every other op elsewhere."""
    return by_op_type(dict.fromkeys(VARIABLE_OP_TYPES, variable_device), other_device)


def short_error(exc: BaseException) -> str:
    """The part of a TensorFlow error worth reading: the type and message, without the
    "Detected at node ... defined at (most recent call last)" source listing, and with node
    attributes in sorted order."""
    lines = [ln for ln in str(exc).splitlines()
             if ln.strip() and not ln.startswith(("Graph execution error", "Detected at node",
                                                  "    File ", "Node: "))]
    text = "\n".join(lines)
    # TensorFlow prints node attributes in hash-map order; sort them so the text is reproducible
    text = re.sub(r"with these attrs: \[([^\]]*)\]",
                  lambda m: "with these attrs: [" + ", ".join(sorted(m[1].split(", "))) + "]", text)
    return f"{type(exc).__name__}: {text}"
