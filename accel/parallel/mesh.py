"""Tensor parallelism with DTensor (``tf.experimental.dtensor``): say how each tensor is split
over a mesh of devices, and let TensorFlow insert the communication.

* ``make_mesh(devices, {"data": 2, "model": 2})``: a mesh (a grid of devices with named axes);
* ``layout(mesh, ["data", None])``: how a tensor is split (a mesh axis name per tensor axis,
  ``None`` = not split); an axis the mesh does not have is a ``ValueError``;
* ``put(array, layout)`` / ``fetch(tensor)``: NumPy to a sharded tensor and back (``fetch``
  relayouts to replicated first: ``.numpy()`` refuses a sharded tensor);
* ``communication(fn, *args)``: the collective ops DTensor put in the graph that ran, counted;
* ``collectives_in(fn, *args)``: each of those ops: its device, the op whose output it
  communicates, and the bytes of that tensor (from the shapes of the graph that ran).

``accel.parallel.megatron.mlp`` itself runs on DTensors: the same code, laid out differently.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from accel import checks
from accel.placement import placement_of, short_device

__all__ = ["make_mesh", "layout", "put", "fetch", "variables", "communication", "Collective",
           "collectives_in"]


def make_mesh(devices: Sequence[str], dims: Mapping[str, int]) -> dtensor.Mesh:
    """A mesh over ``devices`` with axes ``dims`` (name -> size, in order; sizes multiply to
    the number of devices)."""
    sizes = [checks.positive_int(f"dims[{k!r}]", v) for k, v in dims.items()]
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh dims {dict(dims)} hold {int(np.prod(sizes))} devices, "
                         f"got {len(devices)}")
    return dtensor.create_mesh(list(dims.items()), devices=list(devices))


def layout(mesh: dtensor.Mesh, spec: Sequence[str | None]) -> dtensor.Layout:
    """A layout: for each tensor axis, the mesh axis that splits it or ``None``."""
    names = list(mesh.dim_names)
    for s in spec:
        if s is not None and s not in names:
            raise ValueError(f"mesh dimension {s!r} does not exist; the mesh has {names}")
    return dtensor.Layout([dtensor.UNSHARDED if s is None else s for s in spec], mesh)


def put(array, where: dtensor.Layout) -> tf.Tensor:
    """``array`` (NumPy) as a DTensor laid out as ``where``."""
    value = tf.constant(array)
    if value.shape.rank != where.rank:
        raise ValueError(f"layout has rank {where.rank}, the array has shape {value.shape}")
    replicated = dtensor.Layout.replicated(where.mesh, where.rank)
    return dtensor.relayout(dtensor.copy_to_mesh(value, replicated), where)


def fetch(tensor) -> np.ndarray:
    """A DTensor (or DVariable) as one NumPy array."""
    where = dtensor.fetch_layout(tensor)
    whole = dtensor.Layout.replicated(where.mesh, where.rank)
    return dtensor.relayout(tf.convert_to_tensor(tensor), whole).numpy()


def variables(params: Mapping[str, np.ndarray], layouts: Mapping[str, dtensor.Layout]
              ) -> dict[str, dtensor.DVariable]:
    """``DVariable``s holding ``params``, each laid out as ``layouts[name]``."""
    missing = sorted(set(params) - set(layouts))
    if missing:
        raise ValueError(f"no layout for {missing}")
    return {k: dtensor.DVariable(put(v, layouts[k])) for k, v in params.items()}


def communication(fn, *args) -> Counter:
    """Run ``fn(*args)`` once and count the collective ops (``Collective*``, ``*AllToAll*``)
    in the partition graphs that ran, over all devices: what DTensor inserted."""
    ran = placement_of(fn, *args)
    return Counter(r.op_type for r in ran.rows
                   if r.op_type.startswith("Collective") or "AllToAll" in r.op_type)


@dataclass(frozen=True)
class Collective:
    """One collective op of a partition graph that ran: on ``device``, of type ``op_type``,
    communicating the output of op ``after`` (DTensor's name for the op whose result needed
    it), a tensor of ``shape`` and ``nbytes`` bytes on this device."""

    device: str
    op_type: str
    after: str
    shape: tuple[int, ...]
    nbytes: int


def _is_collective(op_type: str) -> bool:
    return op_type.startswith("Collective") or "AllToAll" in op_type


def _shape_of(node) -> tuple[int, ...] | None:
    shapes = node.attr["_output_shapes"].list.shape
    if not shapes or shapes[0].unknown_rank or any(d.size < 0 for d in shapes[0].dim):
        return None
    return tuple(int(d.size) for d in shapes[0].dim)


def collectives_in(fn, *args) -> list[Collective]:
    """Run ``fn(*args)`` once and list the collective ops (as ``communication`` counts them)
    of the partition graphs that ran, each with the tensor it was handed on its device: the
    output of its first input, shape from the graph's ``_output_shapes`` (``ValueError`` where
    it is not known). The bytes are what each device contributes; what a link carries depends
    on the collective's algorithm (a ring all-reduce sends ``2 (n - 1) / n`` of it)."""
    ran = placement_of(fn, *args)
    out = []
    for graph in ran.graphs:
        nodes = {node.name: node for node in graph.node}
        for node in graph.node:
            if not _is_collective(node.op):
                continue
            source = nodes.get(node.input[0].split(":")[0].lstrip("^")) if node.input else None
            shape = _shape_of(source) if source is not None else None
            if shape is None:
                raise ValueError(f"{node.name} on {node.device}: the shape of its input is not "
                                 "known; cannot count its bytes")
            size = tf.as_dtype(node.attr["T"].type).size
            after = re.sub(r"^(tf\.)?StatefulPartitionedCall/", "",
                           node.input[0].split(":")[0].lstrip("^"))
            out.append(Collective(short_device(node.device), node.op, after, shape,
                                  int(np.prod(shape)) * size))
    return out
