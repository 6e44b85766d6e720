"""Megatron-LM's tensor parallelism written by hand, on arrays and variables: each layer's
matrices split across devices (Shoeybi et al. 2019, arXiv:1909.08053, section 3); chapter 11
builds it step by step. For a Keras model, ``accel.parallel.tensor`` has the same splits as Keras
layers and converts a model by rules.

Activations between the split layers are *replicated*: a list with one copy per device. Two
conjugate operators join the pieces (the paper's f and g):

* ``copy_to_shards`` (f): forward, each device keeps its copy; backward, an all-reduce adds the
  partial input gradients the devices computed.
* ``reduce_from_shards`` (g): forward, an all-reduce adds the partial sums; backward, each device
  keeps its gradient (every device computes the same thing downstream, so they agree).

With them: ``column_parallel_dense`` (weight split by output columns; ``gather_from_shards`` if
the full output is needed), ``row_parallel_dense`` (weight split by input rows, partial sums
added by g), ``tp_mlp`` (column then row: one all-reduce forward, one backward) and ``tp_block``
(a pre-LayerNorm transformer block, heads split: two all-reduces forward, two backward). The
single-device references are ``mlp`` and ``block``; ``shard`` / ``unshard`` split a parameter
dict and put it back together. Every device's compute runs through
``accel.collectives.on_device``, so its backward stays on that device too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import (
    all_reduce,
    all_reduce_bytes,
    check_tensors,
    collective_op,
    on_device,
    place,
)

__all__ = ["SPLIT_AXES", "init_block", "mlp", "block", "layer_norm", "attention", "shard",
           "unshard", "to_variables", "copy_to_shards", "reduce_from_shards",
           "gather_from_shards", "column_parallel_dense", "row_parallel_dense", "tp_mlp",
           "tp_block", "all_reduces_per_step", "bytes_per_step"]

# how each parameter is split: axis of the split, or None = replicated on every device
SPLIT_AXES: dict[str, int | None] = {
    "ln1_g": None, "ln1_b": None, "ln2_g": None, "ln2_b": None,
    "wq": 1, "wk": 1, "wv": 1, "bq": 0, "bk": 0, "bv": 0,  # column-parallel (by heads)
    "wo": 0, "bo": None,                                    # row-parallel
    "w1": 1, "b1": 0, "w2": 0, "b2": None,                  # the MLP: column then row
}


def init_block(hidden: int, heads: int, ffn: int | None = None, seed: int = 0,
               dtype=np.float32) -> dict[str, np.ndarray]:
    """A transformer block's parameters as NumPy arrays (``w1, b1, w2, b2`` alone are the MLP)."""
    hidden, heads = checks.positive_int("hidden", hidden), checks.positive_int("heads", heads)
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    ffn = 4 * hidden if ffn is None else checks.positive_int("ffn", ffn)
    rng = np.random.default_rng(seed)
    p = {}
    for name, shape in [("wq", (hidden, hidden)), ("wk", (hidden, hidden)),
                        ("wv", (hidden, hidden)), ("wo", (hidden, hidden)),
                        ("w1", (hidden, ffn)), ("w2", (ffn, hidden))]:
        p[name] = rng.normal(0, 1 / np.sqrt(shape[0]), shape)
    for name, size in [("bq", hidden), ("bk", hidden), ("bv", hidden), ("bo", hidden),
                       ("b1", ffn), ("b2", hidden), ("ln1_b", hidden), ("ln2_b", hidden)]:
        p[name] = rng.normal(0, 0.1, size)
    p["ln1_g"], p["ln2_g"] = 1 + rng.normal(0, 0.1, hidden), 1 + rng.normal(0, 0.1, hidden)
    return {k: v.astype(dtype) for k, v in p.items()}


def layer_norm(x, g, b, eps: float = 1e-5):
    """LayerNorm over the last axis."""
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + eps) * g + b


def mlp(p: Mapping, x):
    """The MLP: ``gelu(x @ w1 + b1) @ w2 + b2``."""
    return tf.matmul(tf.nn.gelu(tf.matmul(x, p["w1"]) + p["b1"]), p["w2"]) + p["b2"]


def attention(p: Mapping, u, heads: int):
    """Multi-head self-attention of ``u`` ([batch, seq, width]) before the output projection's
    bias: ``concat_heads(softmax(q k^T / sqrt(d)) v) @ wo`` (with ``heads`` heads of width d)."""
    batch, seq = tf.shape(u)[0], tf.shape(u)[1]

    def heads_first(t):
        t = tf.reshape(t, [batch, seq, heads, -1])
        return tf.transpose(t, [0, 2, 1, 3])

    q, k, v = (heads_first(tf.matmul(u, p[w]) + p[b]) for w, b in
               [("wq", "bq"), ("wk", "bk"), ("wv", "bv")])
    scale = tf.math.rsqrt(tf.cast(tf.shape(q)[-1], q.dtype))
    o = tf.matmul(tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * scale), v)
    o = tf.reshape(tf.transpose(o, [0, 2, 1, 3]), [batch, seq, -1])
    return tf.matmul(o, p["wo"])


def block(p: Mapping, x, heads: int):
    """A pre-LayerNorm transformer block on one device: ``h = x + attn(ln1(x)) + bo``,
    ``out = h + mlp(ln2(h))``."""
    h = x + attention(p, layer_norm(x, p["ln1_g"], p["ln1_b"]), heads) + p["bo"]
    return h + mlp(p, layer_norm(h, p["ln2_g"], p["ln2_b"]))


def shard(params: Mapping, n: int, heads: int | None = None) -> list[dict]:
    """Split ``params`` for ``n`` devices by ``SPLIT_AXES`` (keys not in it are refused)."""
    n = checks.positive_int("n", n)
    if heads is not None and checks.positive_int("heads", heads) % n:
        raise ValueError(f"heads={heads} is not divisible by n={n} devices")
    unknown = sorted(set(params) - set(SPLIT_AXES))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; known: {sorted(SPLIT_AXES)}")
    shards: list[dict] = [{} for _ in range(n)]
    for name, value in params.items():
        axis = SPLIT_AXES[name]
        if axis is not None and np.shape(value)[axis] % n:
            raise ValueError(f"{name} has size {np.shape(value)[axis]} on the split axis "
                             f"{axis}, not divisible by n={n} devices")
        parts = [value] * n if axis is None else np.split(np.asarray(value), n, axis=axis)
        for s, part in zip(shards, parts, strict=True):
            s[name] = np.asarray(part)
    return shards


def unshard(shards: Sequence[Mapping]) -> dict[str, np.ndarray]:
    """Put split parameters (or their gradients) back together; a replicated one is taken from
    device 0 (``ValueError`` if the copies differ by more than rtol 1e-6)."""
    full = {}
    for name in shards[0]:
        parts = [np.asarray(s[name]) for s in shards]
        axis = SPLIT_AXES[name]
        if axis is None:
            if any(not np.allclose(parts[0], q, rtol=1e-6, atol=0) for q in parts[1:]):
                raise ValueError(f"the replicated {name} differs across devices")
            full[name] = parts[0]
        else:
            full[name] = np.concatenate(parts, axis=axis)
    return full


def to_variables(shards: Sequence[Mapping], devices: Sequence[str]) -> list[dict]:
    """Each device's shard as ``tf.Variable``s created on that device."""
    if len(shards) != len(devices):
        raise ValueError(f"got {len(shards)} shards for {len(devices)} devices")
    out = []
    for s, d in zip(shards, devices, strict=True):
        with tf.device(d):
            out.append({k: tf.Variable(v, name=k) for k, v in s.items()})
    return out


def copy_to_shards(xs: Sequence, devices: Sequence[str]) -> list:
    """Megatron's f: identity forward; all-reduce of the gradients backward."""
    xs = check_tensors(xs, devices)
    return collective_op("CopyToShards", xs, devices, lambda t: place(list(t), devices),
                         lambda dys: all_reduce(dys, devices))


def reduce_from_shards(partials: Sequence, devices: Sequence[str]) -> list:
    """Megatron's g: all-reduce forward; identity backward."""
    partials = check_tensors(partials, devices)
    return collective_op("ReduceFromShards", partials, devices,
                         lambda t: all_reduce(t, devices), lambda dys: place(list(dys), devices))


def gather_from_shards(parts: Sequence, devices: Sequence[str]) -> list:
    """All-gather along the last axis forward; backward each device keeps its own slice."""
    parts = check_tensors(parts, devices)
    n, width = len(devices), parts[0].shape[-1]

    def forward(ts):
        return place([tf.concat(ts, -1)] * n, devices) if n > 1 else place(list(ts), devices)

    def backward(dys):
        return place([dy[..., j * width:(j + 1) * width] for j, dy in enumerate(dys)], devices)

    return collective_op("GatherFromShards", parts, devices, forward, backward)


def _check_shards(shards: Sequence[Mapping], devices: Sequence[str], names: Sequence[str]):
    if len(shards) != len(devices):
        raise ValueError(f"got {len(shards)} shards for {len(devices)} devices")
    for name in names:
        shapes = [tuple(s[name].shape) for s in shards]
        if len(set(shapes)) > 1:
            raise ValueError(f"shards of {name} differ in shape across devices: {shapes}")


def column_parallel_dense(xs: Sequence, ws: Sequence, bs: Sequence, devices: Sequence[str],
                          gather: bool = False) -> list:
    """``x @ w + b`` with ``w`` split by output columns: device i computes its columns. Returns
    the column slices, or (``gather=True``) the full output on every device."""
    _check_shards([{"w": w, "b": b} for w, b in zip(ws, bs, strict=True)], devices, ["w", "b"])
    xs = copy_to_shards(xs, devices)
    ys = [on_device(lambda x, w=w, b=b: tf.matmul(x, w) + b, d, x)
          for x, w, b, d in zip(xs, ws, bs, devices, strict=True)]
    return gather_from_shards(ys, devices) if gather else ys


def row_parallel_dense(x_parts: Sequence, ws: Sequence, b, devices: Sequence[str]) -> list:
    """``x @ w + b`` with ``w`` split by input rows and ``x`` by its last axis to match: partial
    sums on each device, added by an all-reduce (g); ``b`` (one per device) is added after."""
    _check_shards([{"w": w} for w in ws], devices, ["w"])
    partial = [on_device(lambda x, w=w: tf.matmul(x, w), d, x)
               for x, w, d in zip(x_parts, ws, devices, strict=True)]
    summed = reduce_from_shards(partial, devices)
    return [on_device(lambda y, bb=bb: y + bb, d, y) for y, bb, d in zip(summed, b, devices,
                                                                          strict=True)]


def tp_mlp(shards: Sequence[Mapping], xs: Sequence, devices: Sequence[str]) -> list:
    """The Megatron MLP: f, ``gelu(x @ w1_i + b1_i) @ w2_i`` on device i, g, ``+ b2``."""
    _check_shards(shards, devices, ["w1", "b1", "w2"])
    xs = copy_to_shards(xs, devices)
    partial = [on_device(lambda x, p=p: tf.matmul(tf.nn.gelu(tf.matmul(x, p["w1"]) + p["b1"]),
                                                  p["w2"]), d, x)
               for x, p, d in zip(xs, shards, devices, strict=True)]
    ys = reduce_from_shards(partial, devices)
    return [on_device(lambda y, p=p: y + p["b2"], d, y) for y, p, d in zip(ys, shards, devices,
                                                                            strict=True)]


def tp_block(shards: Sequence[Mapping], xs: Sequence, devices: Sequence[str],
             heads: int) -> list:
    """``block`` with the heads split: device i holds ``heads / n`` heads (its columns of
    ``wq, wk, wv``, its rows of ``wo``) and its slice of the MLP; LayerNorms, ``bo`` and ``b2``
    are replicated. Two all-reduces forward (after attention, after the MLP), two backward."""
    n = len(devices)
    if checks.positive_int("heads", heads) % n:
        raise ValueError(f"heads={heads} is not divisible by n={n} devices")
    _check_shards(shards, devices, list(SPLIT_AXES))
    # each tensor is used once outside on_device: a tensor used twice gets its gradients
    # summed by the tape on the default device, so every fork happens inside one on_device
    xus = [on_device(lambda x, p=p: [tf.identity(x), layer_norm(x, p["ln1_g"], p["ln1_b"])],
                     d, x) for x, p, d in zip(xs, shards, devices, strict=True)]
    us = copy_to_shards([u for _, u in xus], devices)
    partial = [on_device(lambda u, p=p: attention(p, u, heads // n), d, u)
               for u, p, d in zip(us, shards, devices, strict=True)]
    att = reduce_from_shards(partial, devices)

    def residual_and_norm(x, a, p):
        h = x + a + p["bo"]
        return [h, layer_norm(h, p["ln2_g"], p["ln2_b"])]

    hvs = [on_device(lambda x, a, p=p: residual_and_norm(x, a, p), d, xu[0], a)
           for xu, a, p, d in zip(xus, att, shards, devices, strict=True)]
    ms = tp_mlp(shards, [v for _, v in hvs], devices)
    return [on_device(lambda h, m: h + m, d, hv[0], m) for hv, m, d in zip(hvs, ms, devices,
                                                                            strict=True)]


def all_reduces_per_step(kind: str) -> dict[str, int]:
    """All-reduces per layer in a training step (forward, backward): Megatron-LM section 3."""
    checks.one_of("kind", kind, ("mlp", "block"))
    per = 1 if kind == "mlp" else 2
    return {"forward": per, "backward": per}


def bytes_per_step(kind: str, activation_shape: Sequence[int], n: int, itemsize: int = 4,
                   layers: int = 1) -> int:
    """Bytes each device sends per training step: all-reduces x the bytes of one all-reduce of
    an activation (``activation_shape``, e.g. [batch, seq, hidden]) on ``n`` devices."""
    count = sum(all_reduces_per_step(kind).values()) * checks.positive_int("layers", layers)
    nbytes = int(np.prod(activation_shape)) * checks.positive_int("itemsize", itemsize)
    return count * all_reduce_bytes(nbytes, checks.positive_int("n", n))
