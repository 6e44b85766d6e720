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
``accel.collectives.on_device``, so its backward stays on that device too. The all-reduces are
``accel.collectives.all_reduce`` with a chosen ``algorithm`` ("direct" by default: each device
sends its whole partial sum to each of the others; "ring": a reduce-scatter then an all-gather).

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, section 4.2.2 and Figure 5): ``tp_mlp`` and ``tp_block``
with ``sequence_parallel=True`` keep the activations *between* the tensor-parallel regions (the
LayerNorms, the residual additions, the biases ``bo`` and ``b2``) split along the sequence axis
(``SEQ_AXIS``), device i holding its ``seq / n`` positions, instead of replicated. The paper's
operators replace f and g at the edges of each region:

* ``gather_sequence`` (the paper's g): all-gather along the sequence forward, reduce-scatter
  backward (entering a region);
* ``scatter_sequence`` (the paper's g-bar): reduce-scatter along the sequence forward, all-gather
  backward (leaving a region: it adds the partial sums and splits the result).

(That paper calls the tensor-parallel operators f and f-bar; this module keeps the 2019 paper's
f and g for ``copy_to_shards`` and ``reduce_from_shards``.)

An all-reduce is a reduce-scatter followed by an all-gather (the ring does exactly that), so the
bytes sent equal those of the ring all-reduce version (``bytes_per_phase`` counts both), while
the activations between the regions take ``1 / n`` of the memory (``region_activation_bytes``
counts them from the placed tensors). Every device now sees only its own positions in the
sequence-parallel regions, so the gradients of the replicated parameters used there (the
LayerNorms, ``bo``, ``b2``) are partial on each device; they are added across the devices by an
all-reduce in the backward pass (here: the parameters enter through f, ``copy_to_shards``), as
Megatron-LM all-reduces them (``megatron/core/distributed/finalize_model_grads.py``,
``_allreduce_layernorm_grads``, "for sequence parallelism"). Not modelled: Megatron stores the
sequence shard of the all-gathered input of a column-parallel layer and gathers it again in the
backward pass (the paper, section 4.2.2); here the gradient tape keeps the gathered tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import (
    all_gather,
    all_gather_bytes,
    all_reduce,
    all_reduce_bytes,
    check_tensors,
    collective_op,
    on_device,
    place,
    reduce_scatter,
    reduce_scatter_bytes,
)

__all__ = ["SPLIT_AXES", "SEQ_AXIS", "REGION_TENSORS", "init_block", "mlp", "block",
           "layer_norm", "attention", "shard", "unshard", "to_variables", "copy_to_shards",
           "reduce_from_shards", "gather_from_shards", "gather_sequence", "scatter_sequence",
           "column_parallel_dense", "row_parallel_dense", "tp_mlp", "tp_block",
           "region_activation_bytes", "all_reduces_per_step", "bytes_per_phase",
           "bytes_per_step"]

# how each parameter is split: axis of the split, or None = replicated on every device
SPLIT_AXES: dict[str, int | None] = {
    "ln1_g": None, "ln1_b": None, "ln2_g": None, "ln2_b": None,
    "wq": 1, "wk": 1, "wv": 1, "bq": 0, "bk": 0, "bv": 0,  # column-parallel (by heads)
    "wo": 0, "bo": None,                                    # row-parallel
    "w1": 1, "b1": 0, "w2": 0, "b2": None,                  # the MLP: column then row
}
# the sequence axis of the activations ([batch, seq, hidden]) that sequence parallelism splits
SEQ_AXIS = 1
# the replicated parameters used between the tensor-parallel regions (partial gradients under
# sequence parallelism), by where they are used
_BLOCK_REPLICATED = ("ln1_g", "ln1_b", "bo", "ln2_g", "ln2_b")
_MLP_REPLICATED = ("b2",)
# the activations a device holds between the tensor-parallel regions of ``tp_block``
REGION_TENSORS = ("x", "ln1", "attn", "h", "ln2", "mlp", "out")


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


def copy_to_shards(xs: Sequence, devices: Sequence[str], algorithm: str = "direct") -> list:
    """Megatron's f: identity forward; all-reduce of the gradients backward (by ``algorithm``,
    one of ``accel.collectives.ALGORITHMS``)."""
    xs = check_tensors(xs, devices)
    return collective_op("CopyToShards", xs, devices, lambda t: place(list(t), devices),
                         lambda dys: all_reduce(dys, devices, algorithm))


def reduce_from_shards(partials: Sequence, devices: Sequence[str],
                       algorithm: str = "direct") -> list:
    """Megatron's g: all-reduce forward (by ``algorithm``); identity backward."""
    partials = check_tensors(partials, devices)
    return collective_op("ReduceFromShards", partials, devices,
                         lambda t: all_reduce(t, devices, algorithm),
                         lambda dys: place(list(dys), devices))


def gather_sequence(xs: Sequence, devices: Sequence[str]) -> list:
    """Sequence parallelism's g (Korthikanti et al. 2022, section 4.2.2): each device's
    sequence shard ``[batch, seq / n, hidden]`` all-gathered along ``SEQ_AXIS`` forward, so every
    device holds the whole sequence; backward, a reduce-scatter (the devices' partial gradients
    added, each device keeping its own positions). ``accel.collectives.all_gather``."""
    return all_gather(xs, devices, SEQ_AXIS)


def scatter_sequence(partials: Sequence, devices: Sequence[str]) -> list:
    """Sequence parallelism's g-bar (section 4.2.2): the partial sums ``[batch, seq, hidden]``
    added and split along ``SEQ_AXIS`` (a reduce-scatter) forward; backward, an all-gather.
    ``accel.collectives.reduce_scatter``."""
    return reduce_scatter(partials, devices, SEQ_AXIS)


def _edges(devices, sequence_parallel: bool, algorithm: str):
    """The operators entering and leaving a tensor-parallel region: (f, g) or, with sequence
    parallelism, (g, g-bar) of Korthikanti et al."""
    if sequence_parallel:
        return (lambda xs: gather_sequence(xs, devices),
                lambda ps: scatter_sequence(ps, devices))
    return (lambda xs: copy_to_shards(xs, devices, algorithm),
            lambda ps: reduce_from_shards(ps, devices, algorithm))


def _replicated(shards, names, devices, sequence_parallel: bool, algorithm: str) -> list[dict]:
    """The replicated parameters ``names`` as tensors on each device; with sequence parallelism
    they pass through f, so that their gradients (partial: each device saw its own positions)
    are all-reduced in the backward pass."""
    per_name = {}
    for name in names:
        values = place([s[name] for s in shards], devices)
        per_name[name] = (copy_to_shards(values, devices, algorithm) if sequence_parallel
                          else values)
    return [{name: per_name[name][i] for name in names} for i in range(len(devices))]


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


def tp_mlp(shards: Sequence[Mapping], xs: Sequence, devices: Sequence[str],
           sequence_parallel: bool = False, algorithm: str = "direct") -> list:
    """The Megatron MLP: f, ``gelu(x @ w1_i + b1_i) @ w2_i`` on device i, g, ``+ b2``.

    With ``sequence_parallel``, ``xs[i]`` is device i's sequence shard ``[batch, seq / n,
    hidden]`` (the sequence split in ``n`` consecutive pieces) and so is the result: g and g-bar
    (``gather_sequence``, ``scatter_sequence``) take the places of f and g, and ``b2``'s gradient
    is all-reduced. ``algorithm`` is the all-reduce's (``accel.collectives.ALGORITHMS``)."""
    _check_shards(shards, devices, ["w1", "b1", "w2"])
    enter, leave = _edges(devices, sequence_parallel, algorithm)
    reps = _replicated(shards, _MLP_REPLICATED, devices, sequence_parallel, algorithm)
    xs = enter(xs)
    partial = [on_device(lambda x, p=p: tf.matmul(tf.nn.gelu(tf.matmul(x, p["w1"]) + p["b1"]),
                                                  p["w2"]), d, x)
               for x, p, d in zip(xs, shards, devices, strict=True)]
    ys = leave(partial)
    return [on_device(lambda y, b: y + b, d, y, r["b2"])
            for y, r, d in zip(ys, reps, devices, strict=True)]


def _block(shards, xs, devices, heads, sequence_parallel, algorithm):
    """``tp_block``'s forward pass; also returns, per device, the tensors it holds between the
    tensor-parallel regions (``REGION_TENSORS``)."""
    n = len(devices)
    if checks.positive_int("heads", heads) % n:
        raise ValueError(f"heads={heads} is not divisible by n={n} devices")
    _check_shards(shards, devices, list(SPLIT_AXES))
    enter, leave = _edges(devices, sequence_parallel, algorithm)
    reps = _replicated(shards, _BLOCK_REPLICATED, devices, sequence_parallel, algorithm)
    # each tensor is used once outside on_device: a tensor used twice gets its gradients
    # summed by the tape on the default device, so every fork happens inside one on_device
    xus = [on_device(lambda x, g, b: [tf.identity(x), layer_norm(x, g, b)], d, x,
                     r["ln1_g"], r["ln1_b"]) for x, r, d in zip(xs, reps, devices, strict=True)]
    us = enter([u for _, u in xus])
    partial = [on_device(lambda u, p=p: attention(p, u, heads // n), d, u)
               for u, p, d in zip(us, shards, devices, strict=True)]
    att = leave(partial)

    def residual_and_norm(x, a, bo, g, b):
        h = x + a + bo
        return [h, layer_norm(h, g, b)]

    hvs = [on_device(residual_and_norm, d, xu[0], a, r["bo"], r["ln2_g"], r["ln2_b"])
           for xu, a, r, d in zip(xus, att, reps, devices, strict=True)]
    ms = tp_mlp(shards, [v for _, v in hvs], devices, sequence_parallel, algorithm)
    outs = [on_device(lambda h, m: h + m, d, hv[0], m) for hv, m, d in zip(hvs, ms, devices,
                                                                            strict=True)]
    held = [dict(zip(REGION_TENSORS, (x, xu[1], a, hv[0], hv[1], m, o), strict=True))
            for x, xu, a, hv, m, o in zip(xs, xus, att, hvs, ms, outs, strict=True)]
    return outs, held


def tp_block(shards: Sequence[Mapping], xs: Sequence, devices: Sequence[str],
             heads: int, sequence_parallel: bool = False, algorithm: str = "direct") -> list:
    """``block`` with the heads split: device i holds ``heads / n`` heads (its columns of
    ``wq, wk, wv``, its rows of ``wo``) and its slice of the MLP; LayerNorms, ``bo`` and ``b2``
    are replicated. Two all-reduces forward (after attention, after the MLP), two backward
    (Shoeybi et al. 2019, section 3, Figure 4), by ``algorithm``.

    With ``sequence_parallel`` (Korthikanti et al. 2022, section 4.2.2, Figure 5), ``xs[i]`` is
    device i's sequence shard ``[batch, seq / n, hidden]`` and so is the result; each all-reduce
    becomes a reduce-scatter (g-bar, leaving a region) and an all-gather (g, entering the next),
    and the replicated parameters' gradients are all-reduced (see the module docstring)."""
    return _block(shards, xs, devices, heads, sequence_parallel, algorithm)[0]


def region_activation_bytes(shards: Sequence[Mapping], xs: Sequence, devices: Sequence[str],
                            heads: int, sequence_parallel: bool = False) -> dict[str, dict]:
    """Runs ``tp_block`` forward and counts, from the tensors it placed, the activation bytes
    each device holds between the tensor-parallel regions: ``{device: {name: bytes}}`` for the
    names in ``REGION_TENSORS`` (the block's input, LayerNorm 1's output, the attention's sum,
    the residual ``h``, LayerNorm 2's output, the MLP's sum, the output), keyed by the device
    each tensor is on. Replicated, each is ``batch x seq x hidden``; with sequence parallelism
    ``batch x seq / n x hidden``: ``1 / n`` (Korthikanti et al. 2022, section 4.2.2: the
    ``10 sbh`` of LayerNorm and dropout activations becomes ``10 sbh / t``)."""
    _, held = _block(shards, xs, devices, heads, sequence_parallel, "direct")
    out: dict[str, dict] = {}
    for tensors in held:
        for name, t in tensors.items():
            per = out.setdefault(t.device, {})
            per[name] = per.get(name, 0) + t.shape.num_elements() * t.dtype.size
    return out


def all_reduces_per_step(kind: str) -> dict[str, int]:
    """All-reduces per layer in a training step (forward, backward): Megatron-LM section 3."""
    checks.one_of("kind", kind, ("mlp", "block"))
    per = 1 if kind == "mlp" else 2
    return {"forward": per, "backward": per}


def bytes_per_phase(kind: str, activation_shape: Sequence[int], n: int, itemsize: int = 4,
                    layers: int = 1, sequence_parallel: bool = False,
                    algorithm: str = "direct") -> dict[str, int]:
    """Bytes each device sends in the forward and the backward pass of a training step,
    ``{"forward": ..., "backward": ...}``, for ``layers`` layers of ``kind`` ("mlp" or "block")
    on ``n`` devices with activations of ``activation_shape`` ([batch, seq, hidden], the whole
    sequence) and ``itemsize``-byte elements.

    Tensor parallelism: ``all_reduces_per_step`` all-reduces (by ``algorithm``) of one
    activation in each pass. Sequence parallelism: each all-reduce becomes an all-gather of the
    ``seq / n`` shards and a reduce-scatter of the whole activation, ``2 (n - 1) / n`` of its
    bytes, exactly the ring all-reduce's (a ring all-reduce *is* a reduce-scatter then an
    all-gather); the backward pass also all-reduces (by ``algorithm``) the gradients of the
    replicated parameters used between the regions: ``hidden`` elements for the MLP (``b2``),
    ``6 hidden`` for the block (two LayerNorms' gains and biases, ``bo``, ``b2``)."""
    checks.one_of("kind", kind, ("mlp", "block"))
    layers, itemsize = checks.positive_int("layers", layers), checks.positive_int("itemsize",
                                                                                  itemsize)
    n = checks.positive_int("n", n)
    shape = [checks.positive_int("activation_shape", s) for s in activation_shape]
    nbytes = int(np.prod(shape)) * itemsize
    per = all_reduces_per_step(kind)
    if not sequence_parallel:
        return {phase: layers * count * all_reduce_bytes(nbytes, n, algorithm)
                for phase, count in per.items()}
    if len(shape) != 3:
        raise ValueError("with sequence parallelism activation_shape must be [batch, seq, "
                         f"hidden], got {list(activation_shape)}")
    if shape[SEQ_AXIS] % n:
        raise ValueError(f"seq={shape[SEQ_AXIS]} is not divisible by n={n} devices")
    pair = all_gather_bytes(nbytes // n, n) + reduce_scatter_bytes(nbytes, n)
    params = len(_MLP_REPLICATED) + (len(_BLOCK_REPLICATED) if kind == "block" else 0)
    grads = params * all_reduce_bytes(shape[-1] * itemsize, n, algorithm)
    return {"forward": layers * per["forward"] * pair,
            "backward": layers * (per["backward"] * pair + grads)}


def bytes_per_step(kind: str, activation_shape: Sequence[int], n: int, itemsize: int = 4,
                   layers: int = 1, sequence_parallel: bool = False,
                   algorithm: str = "direct") -> int:
    """Bytes each device sends per training step: ``bytes_per_phase``'s forward + backward
    (without sequence parallelism: all-reduces x the bytes of one all-reduce of an activation,
    e.g. [batch, seq, hidden], on ``n`` devices)."""
    return sum(bytes_per_phase(kind, activation_shape, n, itemsize, layers, sequence_parallel,
                               algorithm).values())
