"""The vocabulary split across devices (Megatron-LM, arXiv:1909.08053, section 3): each device
holds ``vocab / n`` rows of the embedding table, the same rows the output layer uses as columns.

* ``vocab_parallel_embedding``: device i looks up the ids in its range (zeros elsewhere); an
  all-reduce (Megatron's g) adds the partial embeddings.
* ``vocab_parallel_cross_entropy``: device i holds the logits of its slice of the vocabulary.
  The softmax needs the maximum (for stability) and the sum of ``exp`` over the *whole*
  vocabulary, and the loss needs the label's logit, wherever it lives: three small exchanges of
  one number per example instead of gathering ``batch x vocab`` logits.

Both take replicated inputs (a list, one per device) and return one result per device; ids and
labels are int tensors; every device's compute runs through ``on_device``.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accel.collectives import all_gather, check_tensors, on_device
from accel.parallel.megatron import reduce_from_shards

__all__ = ["vocab_ranges", "vocab_parallel_embedding", "vocab_parallel_cross_entropy"]


def vocab_ranges(vocab: int, n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each device's slice of a vocabulary of ``vocab`` ids."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not isinstance(vocab, int) or vocab < 1 or vocab % n:
        raise ValueError(f"vocab={vocab!r} is not divisible by n={n} devices")
    size = vocab // n
    return [(i * size, (i + 1) * size) for i in range(n)]


def _mine(ids, start: int, end: int):
    """Local positions of ``ids`` and the mask of those this device owns."""
    owned = (ids >= start) & (ids < end)
    return tf.where(owned, ids - start, tf.zeros_like(ids)), owned


def vocab_parallel_embedding(ids: Sequence, tables: Sequence, devices: Sequence[str]) -> list:
    """Embeddings of ``ids`` (replicated) from a table split by rows (``tables[i]`` on device
    i, equal shapes), the full result on every device."""
    check_tensors(tables, devices)
    check_tensors(ids, devices)
    rows = int(tables[0].shape[0])
    partial = []
    for i, (x, table, d) in enumerate(zip(ids, tables, devices, strict=True)):
        def lookup(x, table=table, start=i * rows):
            local, owned = _mine(x, start, start + rows)
            found = tf.gather(table, local)
            return found * tf.cast(owned, found.dtype)[..., None]
        partial.append(on_device(lookup, d, x))
    return reduce_from_shards(partial, devices)


def vocab_parallel_cross_entropy(logits: Sequence, labels: Sequence,
                                 devices: Sequence[str]) -> list:
    """Per-example cross-entropy ``logsumexp(all logits) - logit[label]`` with the logits split
    by vocabulary (``logits[i]``: ``[batch, vocab / n]`` on device i), on every device."""
    logits = check_tensors(logits, devices)
    check_tensors(labels, devices)
    width = int(logits[0].shape[-1])
    # 1. the maximum over the whole vocabulary: a constant shift, no gradient needed
    maxima = [on_device(lambda z: tf.stop_gradient(tf.reduce_max(z, -1, keepdims=True)), d, z)
              for z, d in zip(logits, devices, strict=True)]
    top = [on_device(lambda m: tf.reduce_max(m, -1), d, m)
           for m, d in zip(all_gather(maxima, devices, axis=-1), devices, strict=True)]
    # 2. sum of exp over the whole vocabulary, 3. the label's logit from the device holding it
    sums, picked = [], []
    for i, (z, y, m, d) in enumerate(zip(logits, labels, top, devices, strict=True)):
        def local(z, y, m, start=i * width):
            pos, owned = _mine(y, start, start + width)
            mine = tf.gather(z, pos, axis=-1, batch_dims=1) * tf.cast(owned, z.dtype)
            return [tf.reduce_sum(tf.exp(z - m[:, None]), -1), mine]
        s, p = on_device(local, d, z, y, m)
        sums.append(s)
        picked.append(p)
    total, target = reduce_from_shards(sums, devices), reduce_from_shards(picked, devices)
    return [on_device(lambda s, t, m: tf.math.log(s) + m - t, d, s, t, m)
            for s, t, m, d in zip(total, target, top, devices, strict=True)]
