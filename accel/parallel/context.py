"""Context parallelism: self-attention over a sequence split across devices, each device holding
the queries, keys and values of its ``seq / n`` consecutive positions, equal to attention on one
device (forward and gradients, causal or not). Chapter 11 builds it after sequence parallelism.

Tensors are ``[batch, seq, heads, head_dim]`` (``q, k, v`` after their projections); every
function takes lists ``qs, ks, vs`` with device i's shard ``[batch, seq / n, heads, head_dim]``
(positions ``i * seq / n`` to ``(i + 1) * seq / n - 1``) and returns device i's shard of the
output. ``attention`` is the one-device computation ``softmax(q k^T / sqrt(head_dim)) v`` per
head (causal: position p attends to positions <= p). Three ways to split it:

* ``ring_attention`` (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers",
  arXiv:2310.01889, section 3; Megatron-LM's context parallelism and PyTorch's
  ``context_parallel`` build on it): each device keeps its query block while the K/V
  blocks travel around the ring ``0 -> 1 -> ... -> n-1 -> 0`` (``ring_shift``), ``n - 1``
  passes; the partial results are combined by the online softmax (a running maximum and sum of
  exponentials per query, as in blockwise / flash attention: Milakov and Gimelshein 2018,
  arXiv:1805.02867; Dao et al. 2022, arXiv:2205.14135, section 3.1). With ``causal``, blocks
  wholly above the diagonal (keys after every query of the block) are skipped: device i
  computes ``i + 1`` of the ``n`` blocks (the imbalance that Megatron-LM's split of the sequence
  into ``2n`` chunks, device i taking chunks i and ``2n - 1 - i``, evens out:
  ``get_batch_on_this_cp_rank`` in ``megatron/training/utils.py``; not done here).
  The backward pass runs through the same shifts reversed, so the K/V gradients travel back
  around the ring (``n - 1`` passes of dK and dV).
* ``all_gather_attention`` (Llama 3, Dubey et al. 2024, arXiv:2407.21783, section 3.3.2: K and
  V all-gathered, then attention for the local queries): ``accel.collectives.all_gather`` of K
  and V, whose gradient is a reduce-scatter. Each device sends as many bytes as in the ring;
  it holds all of K and V at once.
* ``ulysses_attention`` (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509, section 3):
  an all-to-all turns the sequence split of Q, K and V into a split of the heads (device j gets
  heads ``j * heads / n ...`` for the whole sequence), each device runs ordinary attention on
  its heads, and an all-to-all turns the output back into a sequence split. Needs ``heads``
  divisible by ``n``.

``context_bytes`` gives what each device sends per call, forward and backward, for each method;
the tests check it against ``accel.collectives.sent_bytes`` (the ``_Send`` nodes of the graph
that ran). Every device's computation runs in ``accel.collectives.on_device`` so that its
backward pass stays on it; the collectives carry their own gradients.

What this does not model: on GPUs the ring overlaps each K/V send with the attention of the
block in hand (the paper's point: the ring's communication hides behind compute once a block is
large enough, section 3); logical CPU devices of one process share their cores, and their
buffers (a transfer between them is TensorFlow's same-worker receive path, which shares the
tensor instead of copying it), so there is nothing to overlap here, and timings
of these functions say nothing about it. Nor does it model the fused kernels (FlashAttention)
a real implementation runs per block: each block's scores are materialized here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import (
    all_gather,
    all_gather_bytes,
    all_to_all,
    all_to_all_bytes,
    check_tensors,
    collective_op,
    on_device,
    place,
    reduce_scatter_bytes,
)

__all__ = ["METHODS", "SEQ_AXIS", "HEAD_AXIS", "attention", "ring_shift", "ring_attention",
           "all_gather_attention", "ulysses_attention", "context_bytes"]

METHODS = ("ring", "all_gather", "ulysses")
SEQ_AXIS, HEAD_AXIS = 1, 2  # of [batch, seq, heads, head_dim]


def _scores(q, k, causal: bool, q_offset: int, k_offset: int):
    """``q k^T / sqrt(head_dim)`` as ``[batch, heads, q_len, k_len]``; with ``causal``, -inf
    where the key's position (``k_offset + column``) is after the query's (``q_offset + row``)."""
    s = tf.einsum("bqhd,bkhd->bhqk", q, k) * tf.math.rsqrt(tf.cast(tf.shape(q)[-1], q.dtype))
    if not causal:
        return s
    rows = q_offset + np.arange(q.shape[SEQ_AXIS])[:, None]
    cols = k_offset + np.arange(k.shape[SEQ_AXIS])[None, :]
    return tf.where(tf.constant(rows >= cols), s, tf.constant(-np.inf, s.dtype))


def attention(q, k, v, causal: bool = False, q_offset: int = 0, k_offset: int = 0):
    """Attention on one device, ``[batch, seq, heads, head_dim]`` in and out: per head,
    ``softmax(q k^T / sqrt(head_dim)) v`` (Vaswani et al. 2017, arXiv:1706.03762, section
    3.2.1). With ``causal``, query ``q_offset + i`` attends only to keys ``k_offset + j <=
    q_offset + i`` (every query needs at least one such key)."""
    p = tf.nn.softmax(_scores(q, k, causal, q_offset, k_offset))
    return tf.einsum("bhqk,bkhd->bqhd", p, v)


def _check_qkv(qs, ks, vs, devices) -> tuple[list, list, list, int]:
    """The three lists checked (one tensor per device, all of one 4-D shape); returns them and
    the shard's sequence length."""
    qs, ks, vs = (check_tensors(t, devices) for t in (qs, ks, vs))
    shapes = {tuple(t[0].shape) for t in (qs, ks, vs)}
    if len(shapes) > 1:
        raise ValueError(f"q, k and v shards differ in shape: {sorted(shapes)}; pass "
                         "[batch, seq / n, heads, head_dim] shards of one shape")
    shape = shapes.pop()
    if len(shape) != 4:
        raise ValueError(f"shards must be [batch, seq / n, heads, head_dim], got shape {shape}")
    return qs, ks, vs, shape[SEQ_AXIS]


def ring_shift(tensors: Sequence, devices: Sequence[str], shift: int = 1) -> list:
    """One step around the ring: device ``i`` receives ``tensors[(i - shift) % n]`` (with
    ``shift=1``, every device sends its tensor to the next one). The gradient is the shift the
    other way. (A point-to-point permutation, as JAX's ``ppermute`` or NCCL send/recv pairs;
    ``accel.collectives`` has the collectives, this is the one step a ring needs.)"""
    tensors = check_tensors(tensors, devices)
    devices, n = list(devices), len(tensors)
    # backward, each output's gradient is first pinned to that output's device: the gradient of
    # an output nobody used is a zero the tape makes anywhere; a ring sends it all the same
    return collective_op("RingShift", tensors, devices,
                         lambda ts: place([ts[(i - shift) % n] for i in range(n)], devices),
                         lambda dys: ring_shift(place(list(dys), devices), devices, -shift))


def _first_block(q, k, v, causal, q_offset, k_offset):
    """The online softmax's state after one block: running max ``m``, sum of exponentials
    ``total`` (both ``[batch, heads, q_len, 1]``) and the unnormalized output ``acc``."""
    s = _scores(q, k, causal, q_offset, k_offset)
    m = tf.reduce_max(s, axis=-1, keepdims=True)
    p = tf.exp(s - m)
    return m, tf.reduce_sum(p, -1, keepdims=True), tf.einsum("bhqk,bkhd->bhqd", p, v)


def _next_block(q, k, v, m, total, acc, causal, q_offset, k_offset):
    """The state after one more block: both parts rescaled to the new running max."""
    bm, btotal, bacc = _first_block(q, k, v, causal, q_offset, k_offset)
    new = tf.maximum(m, bm)
    old_scale, block_scale = tf.exp(m - new), tf.exp(bm - new)
    return new, total * old_scale + btotal * block_scale, acc * old_scale + bacc * block_scale


def ring_attention(qs: Sequence, ks: Sequence, vs: Sequence, devices: Sequence[str],
                   causal: bool = False) -> list:
    """Ring attention (Liu et al. 2023, section 3): at step ``s`` device ``i`` holds the K/V
    block of device ``(i - s) % n``, attends to it with its own queries and folds the result
    into its online-softmax state, then passes the block on (``ring_shift``); ``n - 1`` passes.
    With ``causal``, blocks of keys wholly after the device's queries are skipped (the block
    still travels on: every device sends at every step, as a ring's fixed schedule does).
    Returns device i's output shard ``[batch, seq / n, heads, head_dim]``."""
    qs, ks, vs, chunk = _check_qkv(qs, ks, vs, devices)
    devices, n = list(devices), len(devices)
    # which source blocks device i attends to, in ring order
    todo = [[s for s in range(n) if not (causal and (i - s) % n > i)] for i in range(n)]
    states: list = [None] * n
    for s in range(n):
        more_kv = s < n - 1
        for i, d in enumerate(devices):
            if s not in todo[i]:
                continue
            more_q = s != todo[i][-1]
            offsets = (i * chunk, ((i - s) % n) * chunk)

            # every fork happens inside one on_device (as in megatron.tp_block): the query and
            # K/V blocks that are used again leave it as copies
            def step(q, k, v, *state, more_q=more_q, more_kv=more_kv, offsets=offsets):
                new = (_first_block(q, k, v, causal, *offsets) if not state
                       else _next_block(q, k, v, *state, causal, *offsets))
                keep = ([tf.identity(q)] if more_q else []) + (
                    [tf.identity(k), tf.identity(v)] if more_kv else [])
                return [*new, *keep]

            out = on_device(step, d, qs[i], ks[i], vs[i], *(states[i] or ()))
            states[i], rest = out[:3], out[3:]
            if more_q:
                qs[i], rest = rest[0], rest[1:]
            if more_kv:
                ks[i], vs[i] = rest
        if more_kv:
            ks, vs = ring_shift(ks, devices), ring_shift(vs, devices)

    def finish(total, acc):
        return tf.transpose(acc / total, [0, 2, 1, 3])

    return [on_device(finish, d, state[1], state[2])
            for state, d in zip(states, devices, strict=True)]


def all_gather_attention(qs: Sequence, ks: Sequence, vs: Sequence, devices: Sequence[str],
                         causal: bool = False) -> list:
    """Context parallelism as in Llama 3 (Dubey et al. 2024, section 3.3.2): K and V
    all-gathered along the sequence (``accel.collectives.all_gather``; backward, their gradients
    reduce-scattered), then each device's queries attend to the whole sequence."""
    qs, ks, vs, chunk = _check_qkv(qs, ks, vs, devices)
    kf, vf = all_gather(ks, devices, SEQ_AXIS), all_gather(vs, devices, SEQ_AXIS)
    return [on_device(lambda q, k, v, i=i: attention(q, k, v, causal, q_offset=i * chunk), d,
                      q, k, v)
            for i, (q, k, v, d) in enumerate(zip(qs, kf, vf, devices, strict=True))]


def ulysses_attention(qs: Sequence, ks: Sequence, vs: Sequence, devices: Sequence[str],
                      causal: bool = False) -> list:
    """DeepSpeed Ulysses (Jacobs et al. 2023, section 3): an all-to-all each for Q, K and V
    from a split of the sequence to a split of the heads (``accel.collectives.all_to_all``,
    ``split_axis=HEAD_AXIS``, ``concat_axis=SEQ_AXIS``), attention over the whole sequence for
    ``heads / n`` heads on each device, and one all-to-all of the output back. ``ValueError``
    unless ``heads`` is divisible by the number of devices."""
    qs, ks, vs, _ = _check_qkv(qs, ks, vs, devices)
    heads, n = qs[0].shape[HEAD_AXIS], len(devices)
    if heads % n:
        raise ValueError(f"heads={heads} is not divisible by n={n} devices: Ulysses gives "
                         "each device heads / n whole heads")
    qh, kh, vh = (all_to_all(t, devices, HEAD_AXIS, SEQ_AXIS) for t in (qs, ks, vs))
    oh = [on_device(lambda q, k, v: attention(q, k, v, causal), d, q, k, v)
          for q, k, v, d in zip(qh, kh, vh, devices, strict=True)]
    return all_to_all(oh, devices, SEQ_AXIS, HEAD_AXIS)


def context_bytes(method: str, shard_shape: Sequence[int], n: int,
                  itemsize: int = 4) -> dict[str, int]:
    """Bytes each device sends in one attention call, ``{"forward": ..., "backward": ...}``,
    with ``q, k, v`` shards of ``shard_shape`` (``[batch, seq / n, heads, head_dim]``, a
    block of ``B`` bytes) on ``n`` devices:

    * ``ring``: ``n - 1`` passes of a K and a V block forward, ``2 (n - 1) B``; backward the
      gradients travel back the same way, ``2 (n - 1) B`` (a GPU implementation that keeps only
      its own K/V block also sends K and V again in the backward pass: not here, the gradient
      tape keeps them);
    * ``all_gather``: K and V all-gathered, ``2 (n - 1) B``; backward their gradients
      reduce-scattered, ``2 (n - 1) / n x n B``: the same as the ring;
    * ``ulysses``: four all-to-alls (Q, K, V, output) of ``(n - 1) / n x B`` each way:
      ``4 (n - 1) / n B`` (Jacobs et al. 2023, section 3's communication analysis: with
      ``B`` itself ``1 / n`` of the sequence, the volume per device falls as ``1 / n``, while
      the ring's stays ``(n - 1) / n`` of the whole sequence's K and V)."""
    checks.one_of("method", method, METHODS)
    n, itemsize = checks.positive_int("n", n), checks.positive_int("itemsize", itemsize)
    shape = [checks.positive_int("shard_shape", s) for s in shard_shape]
    if len(shape) != 4:
        raise ValueError(f"shard_shape must be [batch, seq / n, heads, head_dim], got "
                         f"{list(shard_shape)}")
    block = int(np.prod(shape)) * itemsize
    if method == "ring":
        return {"forward": 2 * (n - 1) * block, "backward": 2 * (n - 1) * block}
    if method == "all_gather":
        return {"forward": 2 * all_gather_bytes(block, n),
                "backward": 2 * reduce_scatter_bytes(n * block, n)}
    if shape[HEAD_AXIS] % n:
        raise ValueError(f"heads={shape[HEAD_AXIS]} is not divisible by n={n} devices")
    return {"forward": 4 * all_to_all_bytes(block, n), "backward": 4 * all_to_all_bytes(block, n)}
