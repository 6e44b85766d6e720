"""The arithmetic of one transformer layer, the one home of its FLOP and activation counts.

A layer of hidden size ``h`` on ``b`` sequences of ``s`` tokens does, forward,
``24 b s h^2`` FLOPs in its six weight matmuls (query, key, value and output ``h x h``, the MLP's
``h x 4h`` and ``4h x h``; 2 FLOPs per multiply-add), plus ``4 b s^2 h`` for the attention
scores and their product with the values: ``24 b s h^2 (1 + s / 6h)`` (Narayanan et al. 2021,
arXiv:2104.04473, eq. 3). The backward pass costs two forward passes, so training is 3 passes;
recomputing the activations in the backward pass adds a fourth. The attention term is small
when ``s << 6h``; Megatron-LM's first paper (Shoeybi et al. 2019) leaves it out.

Activations kept for the backward pass (16-bit, no recomputation), per micro-batch with ``a``
heads: ``s b h (34 + 5 a s / h)`` bytes; split over ``t`` tensor-parallel devices (no sequence
parallelism), ``s b h (10 + 24 / t + 5 a s / (h t))`` per device (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, section 4).
"""

from __future__ import annotations

from accel import checks

__all__ = ["layer_flops", "layer_activation_bytes"]


def layer_flops(batch: int, seq: int, hidden: int, *, passes: int = 3,
                attention_scores: bool = True) -> float:
    """FLOPs of one transformer layer over ``passes`` forward-pass equivalents (3: forward and
    backward; 4: with recomputation; 1: forward only): ``passes x 24 b s h^2 (1 + s / 6h)``, or
    ``passes x 24 b s h^2`` with ``attention_scores=False``."""
    b, s = checks.positive_int("batch", batch), checks.positive_int("seq", seq)
    h = checks.positive_int("hidden", hidden)
    passes = checks.positive_int("passes", passes)
    return passes * 24 * b * s * h * h * ((1 + s / (6 * h)) if attention_scores else 1)


def layer_activation_bytes(batch: int, seq: int, hidden: int, heads: int,
                           tensor: int = 1) -> float:
    """Activation bytes one layer keeps for the backward pass on one device (16-bit, no
    recomputation), per micro-batch of ``batch`` sequences, the layer split over ``tensor``
    devices: ``s b h (10 + 24 / t + 5 a s / (h t))`` (``s b h (34 + 5 a s / h)`` for ``t = 1``)."""
    for name, v in (("batch", batch), ("seq", seq), ("hidden", hidden), ("heads", heads),
                    ("tensor", tensor)):
        checks.positive_int(name, v)
    s, b, h, t = seq, batch, hidden, tensor
    return s * b * h * (10 + 24 / t + 5 * heads * s / (h * t))
