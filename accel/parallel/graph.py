"""A Keras model as a graph of layer calls, cut into consecutive parts: what the forms that cut
a model (``ModelParallel``, ``Pipeline``) run on each device.

``model_graph(model)`` reads the graph with public Keras API only: a ``Sequential``'s layers
in order, or a functional model's ``get_config()`` (each layer's inbound node names the
tensors it takes: ``keras_history = [layer, node, index]``, with their shapes and dtypes) and
``get_layer``. A layer called more than once (shared weights) cannot be cut through and a
subclassed model has no graph to read: both are refused with a ``ValueError`` that says what to
do. Nested blocks (a custom layer, a ``Sequential`` used as a layer) are one call: they are cut
as a whole.

``cut(graph, sizes)`` splits the calls, in topological order, into consecutive parts of
``sizes`` calls (``split_sizes``: from ``split_points``, the names of the layers that *begin*
each part after the first, as ``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``, or
from the balance rules of ``accel.parallel.partition``). Each ``Part`` receives a *bundle*: the
tensors still needed after the parts before it (its ``inputs``: the model's inputs for the
first), and passes on the tensors still needed after it (its ``outputs``: the model's outputs
for the last). A tensor that skips a part (a skip connection over a cut) passes through it
unchanged, so its gradient comes back the same way: every tensor that crosses a cut reaches
each later part that reads it. ``crossings(parts)`` lists what crosses each cut, with its
shape and bytes per example.

``copy_part(part, device)`` makes a part's working copies on ``device`` (``from_config``,
built there by running them once on zeros, then ``set_weights``); ``run_part(part, copies,
bundle)`` runs them and returns ``(bundle out, the loss terms they added)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from accel import checks
from accel.parallel import partition
from accel.parallel.keras_model import copy_layer

__all__ = ["Ref", "Call", "ModelGraph", "Part", "model_graph", "split_sizes", "cut",
           "crossings", "copy_part", "run_part", "zeros_bundle", "fill"]

Ref = tuple  # (layer name, output index): one tensor of the graph


@dataclass(frozen=True)
class _Hole:
    """A place in a call's arguments where a tensor of the graph goes."""

    ref: Ref


@dataclass
class Call:
    """One layer call: the user's ``layer``, its arguments with ``_Hole`` s for the graph's
    tensors, and the references of its outputs."""

    layer: keras.layers.Layer
    args: list
    kwargs: dict
    outputs: list[Ref]

    @property
    def name(self) -> str:
        return self.layer.name

    def reads(self) -> list[Ref]:
        return [h.ref for h in tf.nest.flatten([self.args, self.kwargs])
                if isinstance(h, _Hole)]


@dataclass
class ModelGraph:
    """The model's inputs and outputs (references), its calls in topological order, and each
    tensor's shape per example and dtype."""

    inputs: list[Ref]
    outputs: list[Ref]
    calls: list[Call]
    specs: dict = field(default_factory=dict)  # ref -> (shape without the batch axis, dtype)


def _holes(value, specs):
    """A config's argument structure with every serialized Keras tensor made a ``_Hole``."""
    if isinstance(value, dict) and value.get("class_name") == "__keras_tensor__":
        cfg = value["config"]
        layer, node, index = cfg["keras_history"]
        ref = (layer, index)
        specs.setdefault(ref, (tuple(cfg["shape"][1:]), cfg["dtype"]))
        return _Hole(ref)
    if isinstance(value, dict):
        return {k: _holes(v, specs) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_holes(v, specs) for v in value]
    return value


def _triples(layers) -> list:
    """A config's ``input_layers`` / ``output_layers``: one ``[name, node, index]`` (a model
    with one) or a list of them."""
    return [layers] if layers and isinstance(layers[0], str) else list(layers)


def model_graph(model) -> ModelGraph:
    """The graph of a built ``keras.Sequential`` or functional ``keras.Model`` (see the module
    docstring); ``ValueError`` for a subclassed model or a layer called more than once."""
    if isinstance(model, keras.Sequential):
        if not model.built or not model.layers:
            raise ValueError("the Sequential has no built layers: start it with keras.Input("
                             "shape) or call it once on a batch before handing it over")
        first = ("__input__", 0)
        specs = {first: (tuple(model.inputs[0].shape[1:]), model.inputs[0].dtype)}
        calls, prev = [], first
        for layer in model.layers:
            out = (layer.name, 0)
            specs[out] = (tuple(layer.output.shape[1:]), layer.output.dtype)
            calls.append(Call(layer, [_Hole(prev)], {}, [out]))
            prev = out
        return ModelGraph([first], [prev], calls, specs)
    if not isinstance(model, keras.Model):
        raise ValueError(f"model must be a keras.Sequential or a functional keras.Model, got "
                         f"{type(model).__name__}")
    try:  # a functional model's config lists its layers and their inbound nodes
        config = model.get_config()
        layers_cfg, _ = config["layers"], config["input_layers"]
    except (NotImplementedError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{type(model).__name__} is a subclassed model: its call() is Python, not a graph "
            "of layers this form can cut. Build it as a functional model (keras.Model(inputs, "
            "outputs)) or a Sequential of blocks; the data-parallel forms (DataParallel, Zero, "
            "Offload, Accumulating, Mirrored) take it as it is") from exc
    specs, calls = {}, []
    inputs = [(name, index) for name, _, index in _triples(config["input_layers"])]
    for lc in layers_cfg:
        nodes = lc.get("inbound_nodes") or []
        if lc["class_name"] == "InputLayer" or not nodes:
            continue
        if len(nodes) > 1:
            raise ValueError(f"layer {lc['name']!r} is called {len(nodes)} times (shared "
                             "weights): a form that cuts the model cannot cut through it; give "
                             "each call its own layer, or wrap the calls that share it in one "
                             "custom layer")
        layer = model.get_layer(lc["name"])
        node = nodes[0]
        args = _holes(node.get("args", []), specs)
        kwargs = _holes(node.get("kwargs", {}), specs)
        outs = layer.output if isinstance(layer.output, list | tuple) else [layer.output]
        refs = [(layer.name, i) for i in range(len(outs))]
        for ref, t in zip(refs, outs, strict=True):
            specs[ref] = (tuple(t.shape[1:]), t.dtype)
        calls.append(Call(layer, args, kwargs, refs))
    for name, index in inputs:
        t = model.get_layer(name).output
        specs[(name, index)] = (tuple(t.shape[1:]), t.dtype)
    outputs = [(name, index) for name, _, index in _triples(config["output_layers"])]
    return ModelGraph(inputs, outputs, calls, specs)


def split_sizes(graph: ModelGraph, num_parts: int, split_points: Sequence[str] | None = None,
                balance="count") -> list[int]:
    """Calls per part: from ``split_points`` (the names of the layers that begin parts 2, 3,
    ...: ``num_parts - 1`` names, in the graph's order), else by ``balance`` (``"count"``,
    ``"bytes"``: parameter bytes, a call without weights 1 byte; or a list of counts)."""
    names = [c.name for c in graph.calls]
    n = len(names)
    checks.positive_int("num_parts", num_parts)
    if n < num_parts:
        raise ValueError(f"the model has {n} layers, fewer than the {num_parts} parts to cut it "
                         "into")
    if split_points is not None:
        if isinstance(split_points, str) or len(split_points) != num_parts - 1:
            raise ValueError(f"split_points {split_points!r}: give {num_parts - 1} layer names "
                             f"(each begins a part after the first) for {num_parts} parts")
        at = []
        for p in split_points:
            if p not in names:
                raise ValueError(f"split point {p!r} is not a layer of the model's graph; its "
                                 f"layers in order: {names}")
            at.append(names.index(p))
        if at != sorted(set(at)) or at[0] == 0:
            raise ValueError(f"split points {list(split_points)} must be distinct layers after "
                             f"the first, in the graph's order: {names}")
        bounds = [0, *at, n]
        return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if isinstance(balance, str):
        checks.one_of("balance", balance, ("count", "bytes"))
        if balance == "count":
            return partition.balance_by_count(n, num_parts)
        costs = [sum(int(w.numpy().nbytes) for w in c.layer.weights) or 1
                 for c in graph.calls]
        return partition.balance_by_cost(costs, num_parts)
    sizes = partition.check_balance(balance, n)
    if len(sizes) != num_parts:
        raise ValueError(f"balance {sizes} has {len(sizes)} parts; this form cuts the model into "
                         f"{num_parts}")
    return sizes


@dataclass
class Part:
    """Consecutive calls of the graph, the bundle of tensors they receive (``inputs``) and the
    bundle they pass on (``outputs``)."""

    calls: list[Call]
    inputs: list[Ref]
    outputs: list[Ref]

    @property
    def layers(self) -> list:
        return [c.layer for c in self.calls]


def cut(graph: ModelGraph, sizes: Sequence[int]) -> list[Part]:
    """The graph's calls cut into consecutive parts of ``sizes`` calls, each with the bundle it
    receives and the one it passes on (see the module docstring)."""
    ranges = partition.part_ranges(list(sizes))
    groups = [[graph.calls[i] for i in r] for r in ranges]
    later_reads: list[set] = []
    needed = set(graph.outputs)
    for calls in reversed(groups):  # what is read at or after each part
        later_reads.append(set(needed))
        for c in calls:
            needed |= set(c.reads())
    later_reads.reverse()  # later_reads[k]: read by parts after k, or a model output
    parts, live = [], list(graph.inputs)
    for k, calls in enumerate(groups):
        made = [r for c in calls for r in c.outputs]
        available = live + [r for r in made if r not in live]
        if k == len(groups) - 1:
            out = list(graph.outputs)
        else:
            out = [r for r in available if r in later_reads[k]]
        missing = [r for c in calls for r in c.reads() if r not in available]
        if missing:  # pragma: no cover - the config's order is topological
            raise ValueError(f"layers {[c.name for c in calls]} read {missing} before it is made")
        parts.append(Part(calls, list(live), out))
        live = out
    return parts


def crossings(graph: ModelGraph, parts: Sequence[Part]) -> list[list[tuple]]:
    """What crosses each cut (after part ``k``, for every part but the last): ``(tensor, shape
    per example, dtype, bytes per example)`` for each tensor of the bundle part ``k`` passes on
    (``"layer:index"`` names the tensor by the layer that made it)."""
    out = []
    for part in parts[:-1]:
        rows = []
        for ref in part.outputs:
            shape, dtype = graph.specs[ref]
            size = int(np.prod(shape)) * tf.as_dtype(dtype).size
            rows.append((f"{ref[0]}:{ref[1]}", shape, str(tf.as_dtype(dtype).name), size))
        out.append(rows)
    return out


def fill(value, values):
    """A call's argument structure with each tensor of the graph taken from ``values``."""
    if isinstance(value, _Hole):
        return values[value.ref]
    if isinstance(value, dict):
        return {k: fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, values) for v in value]
    return value


def run_part(part: Part, copies: Sequence, bundle: Sequence, training: bool = True):
    """``(bundle out, loss terms)``: the part's layer copies (aligned with ``part.calls``) run
    on ``bundle`` (tensors aligned with ``part.inputs``), and the terms they put in their
    ``losses`` (``add_loss``, regularizers) during the calls."""
    values = dict(zip(part.inputs, bundle, strict=True))
    terms = []
    for call, layer in zip(part.calls, copies, strict=True):
        args, kwargs = fill(call.args, values), fill(call.kwargs, values)
        kwargs = {k: v for k, v in kwargs.items() if k != "training"}
        out = layer(*args, training=training, **kwargs)
        outs = out if isinstance(out, list | tuple) else [out]
        for ref, t in zip(call.outputs, outs, strict=True):
            values[ref] = t
        terms.extend(layer.losses)
    return tuple(values[r] for r in part.outputs), terms


def zeros_bundle(graph: ModelGraph, refs: Sequence[Ref]) -> tuple:
    """One example of zeros for each tensor of ``refs`` (its shape and dtype)."""
    return tuple(tf.zeros((1, *graph.specs[r][0]), dtype=graph.specs[r][1]) for r in refs)


def copy_part(graph: ModelGraph, part: Part, device: str) -> list:
    """Working copies of the part's layers with their variables on ``device`` (rebuilt from
    their configs, built there by running the part once on zeros), holding the same weights."""
    with tf.device(device):
        copies = [copy_layer(c.layer) for c in part.calls]
        run_part(part, copies, zeros_bundle(graph, part.inputs), training=False)
        for c, copy in zip(part.calls, copies, strict=True):
            copy.set_weights(c.layer.get_weights())
    return copies
