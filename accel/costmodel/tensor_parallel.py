"""When tensor parallelism pays: a MODEL of one transformer layer split over ``n`` devices, and
the scaling Megatron-LM reports (cited, labelled as reported).

Per layer and training step (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053, section 3):
four all-reduces of the activation ``batch x seq x hidden`` (two forward, two backward), each
costing a device ``2 (n - 1) / n`` times the activation's bytes with a ring all-reduce (what
NCCL does). Data parallelism instead all-reduces the gradients once per step: ``2 (n - 1) / n``
times the layer's parameter bytes. The layer's work: ``24 b s h^2`` FLOPs forward (the four
``h x h`` and two ``h x 4h`` matmuls, 2 FLOPs per multiply-add; attention scores left out),
times 3 for forward + backward. The model assumes no overlap of compute and communication.
"""

from __future__ import annotations

from accel import checks
from accel.costmodel.collectives import ring_all_reduce_bytes
from accel.costmodel.hardware import link_bandwidth, peak_flops
from accel.costmodel.transformer import layer_flops
from accel.costmodel.zero import ADAM_MIXED_BYTES_PER_PARAM

__all__ = ["tp_bytes_per_layer", "dp_bytes_per_layer", "layer_bytes_held",
           "tp_layer_time"]

def tp_bytes_per_layer(batch: int, seq: int, hidden: int, n: int, itemsize: int = 2) -> float:
    """Bytes a device sends per layer and step with tensor parallelism over ``n`` devices."""
    activation = batch * seq * checks.positive_int("hidden", hidden) * itemsize
    return 4 * ring_all_reduce_bytes(activation, n)


def dp_bytes_per_layer(hidden: int, n: int, itemsize: int = 2) -> float:
    """Bytes a device sends per layer and step with data parallelism (gradients of the layer's
    ``12 h^2`` weights all-reduced once)."""
    return ring_all_reduce_bytes(12 * checks.positive_int("hidden", hidden) ** 2 * itemsize, n)


def layer_bytes_held(hidden: int, n: int, parallel: str,
                     bytes_per_param: int = ADAM_MIXED_BYTES_PER_PARAM) -> float:
    """Bytes of weights + gradients + Adam slots a device holds for one layer's ``12 h^2``
    parameters (16 bytes each in mixed precision with Adam: fp16 weight and gradient, fp32
    master weight and two slots): ``1/n`` of it with tensor parallelism, all of it with data."""
    checks.one_of("parallel", parallel, ("tensor", "data"))
    whole = 12 * checks.positive_int("hidden", hidden) ** 2 * bytes_per_param
    return whole / checks.positive_int("n", n) if parallel == "tensor" else whole


def tp_layer_time(batch: int, seq: int, hidden: int, n: int, device: str, link: str,
                  precision: str = "fp16", utilization: float = 0.5,
                  itemsize: int = 2) -> dict[str, float]:
    """MODEL of one layer's training step on ``n`` devices joined by ``link``: compute seconds
    (``layer_flops / n`` at ``utilization`` of the peak), communication seconds (the four
    all-reduces at the link's nominal bandwidth), and the parallel efficiency
    ``t_1 / (n * t_n)``."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    rate = peak_flops(device, precision) * utilization
    compute_1 = layer_flops(batch, seq, hidden, attention_scores=False) / rate
    compute = compute_1 / checks.positive_int("n", n)
    comm = tp_bytes_per_layer(batch, seq, hidden, n, itemsize) / link_bandwidth(link)
    return {"compute_s": compute, "comm_s": comm,
            "efficiency": compute_1 / (n * (compute + comm))}
