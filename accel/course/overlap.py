"""Chapter 07's overlap of the gradient exchange with the backward pass: the towers' bucketed
averaging (``accel.parallel.data``'s ``bucket_bytes``) shown on a deep MLP.

* ``deep_mlp(devices)`` and ``deep_batch()``: the model (``depth`` Dense ReLU layers named
  ``d0, d1, ...`` and an output layer ``out``) and a batch;
* ``tower_steps(model, devices, buckets)``: towers steps of copies of ``model``, one per
  bucket size, and the one-device reference, every copy starting from the same weights;
* ``waits_for(step, x, y)``: per bucket, the layers it holds and the layers whose weight
  gradients its sum waits for (read from the traced graph: the sum's ancestors);
* ``traced_buckets(step, x, y)``: one executed step read back from a profiler trace
  (``accel.profile.op_runs``): when each bucket's sum started, when the towers' backward
  ended, and the intervals of a timeline (``accel.viz.timeline``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from accel import profile
from accel.parallel.data import make_single_step, make_tower_step

__all__ = ["deep_mlp", "deep_batch", "layer_bytes", "tower_steps", "waits_for",
           "traced_buckets"]

LR = 0.01
_LAYER = re.compile(r"/(d\d+|out)(?:_\d+)?/")


def deep_mlp(devices: Sequence[str], depth: int = 8, width: int = 256, seed: int = 0):
    """``depth`` Dense ReLU layers of ``width`` (``d0`` ... ) and a Dense ``out`` of 1, built
    on ``devices[0]`` (the towers' variable device)."""
    keras.utils.set_random_seed(seed)
    with tf.device(devices[0]):
        return keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu", name=f"d{i}") for i in range(depth)]
            + [keras.layers.Dense(1, name="out")])


def deep_batch(model, batch: int = 512, seed: int = 1):
    """A batch of normal inputs for ``model`` and targets that a line of them gives."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, model.inputs[0].shape[-1])).astype("float32")
    return tf.constant(x), tf.constant(x[:, :1] - x[:, 1:2])


def layer_bytes(model, name: str) -> int:
    """Bytes of the gradients of layer ``name`` (its kernel and bias)."""
    return sum(int(np.prod(w.shape)) * tf.as_dtype(w.dtype).size
               for w in model.get_layer(name).trainable_weights)


def _copy(model, device: str):
    with tf.device(device):
        twin = keras.models.clone_model(model)
        twin.set_weights(model.get_weights())
    return twin


def tower_steps(model, devices: Sequence[str], buckets: Mapping[str, int | None]) -> dict:
    """Label -> ``(copy of model, step)``: for each ``buckets`` entry a towers step over
    ``devices`` with that ``bucket_bytes`` (plain SGD, learning rate ``LR``), and ``"one
    device"``: the reference step on ``devices[0]``; every copy starts from ``model``'s
    weights."""
    loss = keras.losses.MeanSquaredError(reduction=None)
    out = {}
    for label, bucket_bytes in buckets.items():
        copy = _copy(model, devices[0])
        out[label] = (copy, make_tower_step(None, loss, copy, LR, devices,
                                            bucket_bytes=bucket_bytes))
    copy = _copy(model, devices[0])
    out["one device"] = (copy, make_single_step(None, loss, copy, LR, devices[0]))
    return out


def _layer_of(op_name: str) -> str | None:
    found = _LAYER.search(op_name)
    return found.group(1) if found else None


def waits_for(model, step, x, y) -> list[tuple[list[str], list[str]]]:
    """Per bucket of ``step`` (a ``make_tower_step`` with ``bucket_bytes``): the variables it
    holds (``"d7/kernel"``), and the layers whose weight-gradient ``MatMul`` (any tower's:
    ``inputs^T @ upstream``, the one with ``transpose_a``) is among the ancestors of the
    bucket's sum in the traced graph: what the sum must wait for."""
    graph = step.get_concrete_function(x, y).graph
    names = ["/".join(v.path.split("/")[-2:]) for v in model.trainable_variables]
    order = [layer.name for layer in model.layers]
    out = []
    for k, bucket in enumerate(step.buckets):
        seen, todo = {}, [graph.get_operation_by_name(f"bucket_{k}/AddN")]
        while todo:
            for t in todo.pop().inputs:
                if t.op.name not in seen:
                    seen[t.op.name] = t.op
                    todo.append(t.op)
        grads = {_layer_of(name) for name, op in seen.items()
                 if name.startswith("gradient_tape/") and op.type == "MatMul"
                 and op.get_attr("transpose_a")}
        out.append(([names[j] for j in bucket], [n for n in order if n in grads]))
    return out


def traced_buckets(step, x, y, logdir: str | None = None) -> dict:
    """One executed step of ``step`` read from a profiler trace (``accel.profile.read_trace``,
    kept under ``logdir`` if given): ``sums`` (per bucket, the
    start and end of its sum, ms from the step's first op), ``backward_end`` (the last weight
    or input gradient ``MatMul`` of any tower), and ``intervals``: ``(lane, start, end,
    label)`` for ``accel.viz.timeline``, a lane per tower's backward (labelled by layer) and
    one for the sums (labelled ``b0``, ``b1``...)."""
    runs = profile.read_trace(lambda: step(x, y), profile.op_runs, logdir)
    backward, sums, intervals = [], {}, []
    for r in runs:
        tower = re.match(r"gradient_tape/tower_(\d+)/", r.name)
        if tower and "MatMul" in r.type:
            backward.append(r.end)
            intervals.append((f"tower {tower.group(1)} backward", r.start, r.end,
                              _layer_of(r.name) or "?"))
        bucket = re.match(r"bucket_(\d+)/AddN$", r.name)
        if bucket:
            sums[int(bucket.group(1))] = (r.start, r.end)
            intervals.append(("bucket sums", r.start, r.end, f"b{bucket.group(1)}"))
    if not backward or not sums:
        raise ValueError("the trace holds no backward MatMul or no bucket sum: was the step "
                         "made with bucket_bytes?")
    lanes = sorted({lane for lane, *_ in intervals}, key=lambda lane: (lane == "bucket sums",
                                                                       lane))
    intervals.sort(key=lambda i: (lanes.index(i[0]), i[1]))  # the same lane order every run
    return {"sums": [sums[k] for k in sorted(sums)], "backward_end": max(backward),
            "intervals": intervals}
