"""A MODEL of one training step of a GPT-like transformer under a data x tensor x pipeline x ZeRO
plan: memory per device and time per step, from plain numbers (no TensorFlow).

* ``Transformer(layers, hidden, heads, seq, vocab)``: the model; ``parameters`` is Narayanan et
  al. 2021 (arXiv:2104.04473) eq. 2, ``12 l h^2 (1 + 13 / 12h + (V + s) / 12lh)``;
* ``Cluster``: GPUs per node, nodes, memory per GPU, dense peak FLOP/s, one-direction bandwidth
  per GPU inside a node and out of it; ``Cluster.dgx_a100(nodes)`` takes every figure from
  ``accel.costmodel.hardware`` (cited there);
* ``Plan(data, tensor, pipeline, zero, microbatch, recompute, sequence_parallel, interleave,
  overlap, attention)``;
* ``STATE_BYTES``: the bytes per parameter of weights, gradients and optimizer state, an
  explicit choice (``precision``), see below;
* ``step_flops``: what a step executes. Full recomputation is the paper's eq. 3,
  ``96 B s l h^2 (1 + s / 6h + V / 16lh)`` (four passes over the layers, three over the logit
  layer); none is ``72 B s l h^2 (1 + s / 6h) + 6 B s h V``; selective recomputation (Korthikanti
  et al. 2022, arXiv:2205.05198, section 5) adds to that the forward of attention's core again,
  its two ``2 b s^2 h`` matmuls: ``4 B s^2 h`` per layer. ``attention="fused"`` (a
  FlashAttention-style kernel, Dao et al. 2022, arXiv:2205.14135, section 3.1 and Algorithm 4)
  keeps no score matrix and selective recomputation has nothing left to rerun. Its backward does
  recompute ``S = Q K^T`` (one ``2 b s^2 h`` matmul per layer) but saves the memory traffic of
  the ``s^2`` matrices, which the model does not charge to materialized attention either, and
  Dao et al. (section 4) measure it faster; the model charges both the same FLOPs: fused
  attention changes memory, not time;
* ``memory_per_device``: weights, gradients and optimizer states of the first pipeline stage
  (the most loaded: its layers and the embedding), each sharded by ZeRO's stage over the data
  replicas; activations of the micro-batches 1F1B keeps in flight (``min(p, m)``), per layer
  and micro-batch Korthikanti et al.'s Table 2 at 16 bits: ``s b h (10 + 24 / t + 5 a s / ht)``
  kept whole, ``s b h (34 / t + 5 a s / ht)`` with sequence parallelism; ``s b h (10 + 24 / t)``
  and ``34 s b h / t`` with selective recomputation; the layer's input, ``2 s b h`` (``2 s b h /
  t`` with sequence parallelism, where the input lives split by sequence), with full
  recomputation, plus one layer's whole set while it is recomputed. Interleaving ``v`` chunks
  multiplies the first stage's activations by ``1 + (p - 1) / (p v)`` (Korthikanti et al.,
  section 4.2.3). With ``attention="fused"`` the ``5 a s / ht`` score term (softmax output,
  dropout mask, dropped-out copy: ``5 a s^2 b`` bytes) becomes the kernel's fp32 log-sum-exp per
  head and token, ``4 a s b / t`` bytes (``4 a / ht`` in units of ``s b h``), so ``"selective"``
  keeps what ``"none"`` keeps. ZeRO 3 (``data > 1``) adds its working set
  (``Memory.working``): one block's weights gathered whole (its tensor shard), twice (the block
  that runs and the next, prefetched), and that block's unsharded gradient before its
  reduce-scatter, ``(2 w + g) x`` one block's parameters; a gathering unit of one block is
  FSDP's per-block wrapping (torchtitan), and DeepSpeed, which gathers per submodule (each
  linear layer, the largest ``4 h^2``, a third of a block) and caps the live parameters
  (``stage3_max_live_parameters``), holds less. With full
  recomputation the model also holds one whole layer's activations while that layer is
  recomputed, the ``5 a s^2 b`` scores included unless attention is fused; so ZeRO-3 figures with
  large heads and micro-batches are upper bounds;
* ``step_time``: compute at ``utilization`` of the peak, the pipeline's clock set by its
  slowest stage, the last (its blocks and the logit layer, as Megatron-LM places it); per layer
  and micro-batch the tensor-parallel all-reduces of the ``s b h`` activation (2 forward, 2
  backward, 2 more when the forward is recomputed in full: Shoeybi et al. 2019); with sequence
  parallelism each becomes a reduce-scatter and an all-gather, the same bytes (Korthikanti et
  al., section 4.2.2). The pipeline's ``(v m + p - 1)`` slots of a chunk's time ``stage / v``
  (bubble ``(p - 1) / (v m + p - 1)``, chapter 10; Narayanan et al. section 2.2.2), each chunk
  boundary sending the activation point-to-point, split over the tensor group (Narayanan et
  al.'s scatter/gather): ``v`` times the sends of 1F1B. Data-parallel traffic of the first
  stage's parameters (the step ends with its backward; Megatron-LM's DDP treats later stages'
  traffic as off the critical path: ``megatron/core/distributed/distributed_data_parallel.py``):
  ZeRO 0 an all-reduce of the gradients per step, ZeRO 1 a reduce-scatter of the gradients
  and an all-gather of the weights (Megatron-LM's distributed optimizer), ZeRO 2 a
  reduce-scatter per micro-batch (it keeps only its gradient shard, as DeepSpeed does) and one
  all-gather, ZeRO 3 two gathers and a reduce-scatter per micro-batch; gradients move at the
  gradients' bytes, weights at the weights'. ``overlap=True`` hides ZeRO 0-1's reduction behind
  the backward of the step's last micro-batch (buckets reduced while the earlier layers' backward
  runs: PyTorch DDP, Megatron-LM's ``--overlap-grad-reduce``), and ZeRO 2-3's per-micro-batch
  traffic behind the compute (prefetching), each up to the compute's length: the step's lower
  bound; ``overlap=False`` hides nothing, the upper bound. Ring collectives run at the nominal
  bandwidth of the slowest link the group crosses.

Bytes per parameter (``STATE_BYTES``, the ``precision`` argument) are a choice, not a fact of
the model: ``"mixed"`` (the default) is the ZeRO paper's count (Rajbhandari et al. 2019, section
3.1): 16-bit weights and gradients, 2 + 2, and Adam's fp32 master weights and two moments, 12;
16 in all. ``"megatron-bf16"`` is Megatron Core's with bf16 weights and fp32 gradients (the
gradients accumulated and reduced in fp32): 2 + 4 + 12 = 18, and ``"megatron-fp16"`` its count
for fp16 weights and gradients, whose optimizer also keeps an fp32 copy of the gradients: 2 + 2
+ 16 = 20 (Megatron Core developer guide, "Distributed Optimizer": 18 and 20 bytes, 6 + 12/d and
4 + 16/d with the distributed optimizer). ``"fp32"``: 4 + 4 + 8, what runs in this course.

``utilization`` defaults to ``UTILIZATION`` = 0.5, the share of the dense peak that every cost
model of this course assumes (chapters 09-11); ``accel.costmodel.megatron_table`` fits it on
three rows of a published table and scores it on the others. ``MEMORY_BUDGET`` = 0.8: the share
of a GPU's memory a plan may fill (``plans.rank_plans``), since the model counts no CUDA context,
no cuBLAS / NCCL workspaces and no allocator fragmentation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from accel import checks
from accel.costmodel.collectives import BUS_FACTORS, ring_all_reduce_bytes
from accel.costmodel.hardware import MEMORY_GB, NODES, link_bandwidth, peak_flops
from accel.costmodel.pipeline import stash_microbatches
from accel.costmodel.transformer import layer_flops

__all__ = ["UTILIZATION", "MEMORY_BUDGET", "STATE_BYTES", "PRECISION", "RECOMPUTE", "ATTENTION",
           "Transformer", "Cluster", "Plan", "Memory", "StepTime", "layer_parameters",
           "stage_parameters", "state_bytes", "layer_activations", "step_flops",
           "microbatches", "dp_bytes", "memory_per_device", "step_time", "stage_state_bytes"]

UTILIZATION = 0.5
# a rule of thumb, not fitted: 16 GB of an 80 GB GPU left for what the model does not count (the
# CUDA context, cuBLAS and NCCL workspaces, the caching allocator's fragmentation, temporaries)
MEMORY_BUDGET = 0.8
# precision -> bytes per parameter of (weights, gradients, optimizer state) with Adam
STATE_BYTES: dict[str, tuple[int, int, int]] = {
    "mixed": (2, 2, 12),          # ZeRO paper, section 3.1: 16
    "megatron-bf16": (2, 4, 12),  # Megatron Core: bf16 params, fp32 grads: 18 (6 + 12/d)
    "megatron-fp16": (2, 2, 16),  # Megatron Core: fp16 params and grads: 20 (4 + 16/d)
    "fp32": (4, 4, 8),            # float32 Adam: the weights are their own master copy
}
PRECISION = "mixed"
DGX_A100_HOST_BYTES = 2e12  # system memory of a DGX A100 640 GB (NVIDIA DGX A100 data sheet, 2020)
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("materialized", "fused")  # scores kept (Korthikanti et al.) or a fused kernel
_SHARDED = {0: (), 1: (2,), 2: (1, 2), 3: (0, 1, 2)}  # ZeRO stage -> sharded parts


@dataclass(frozen=True)
class Transformer:
    """A GPT-like model: ``layers`` blocks of width ``hidden`` with ``heads`` heads, sequences
    of ``seq`` tokens, a vocabulary of ``vocab``."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            checks.positive_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")

    @property
    def parameters(self) -> int:
        """Eq. 2 of Narayanan et al.: ``12 l h^2 + 13 l h + (V + s) h``."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + self.seq) * h


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs; bandwidths are per GPU, one direction;
    ``host_memory_bytes``: the system memory of one node (0: not known)."""

    gpus_per_node: int
    nodes: int
    memory_bytes: float
    peak_flops: float
    intra_node_bps: float
    inter_node_bps: float
    host_memory_bytes: float = 0.0

    def __post_init__(self):
        checks.positive_int("gpus_per_node", self.gpus_per_node)
        checks.positive_int("nodes", self.nodes)
        for name in ("memory_bytes", "peak_flops", "intra_node_bps", "inter_node_bps"):
            checks.positive_number(name, getattr(self, name))
        checks.non_negative_number("host_memory_bytes", self.host_memory_bytes)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def dgx_a100(cls, nodes: int, gpus: int | None = None) -> Cluster:
        """DGX A100 nodes (A100 80 GB, bf16 dense peak, NVLink 3 through NVSwitch, one HDR
        adapter per GPU, 2 TB of system memory: NVIDIA DGX A100 data sheet, 2020, the 640 GB
        system); ``gpus`` (a multiple of 8) instead of ``nodes`` if given."""
        per_node, out = NODES["DGX A100"]
        if gpus is not None:
            if checks.positive_int("gpus", gpus) % per_node:
                raise ValueError(f"gpus={gpus} is not a multiple of {per_node} GPUs per node")
            nodes = gpus // per_node
        return cls(per_node, checks.positive_int("nodes", nodes),
                   MEMORY_GB["NVIDIA A100"].value * 1e9, peak_flops("NVIDIA A100", "bf16"),
                   link_bandwidth("NVLink 3 (A100, per GPU)"), out.value * 1e9, DGX_A100_HOST_BYTES)


@dataclass(frozen=True)
class Plan:
    """``data`` x ``tensor`` x ``pipeline`` GPUs; ZeRO stage ``zero`` (0-3) over the data
    replicas; micro-batches of ``microbatch`` sequences; ``recompute`` one of ``RECOMPUTE``;
    ``sequence_parallel`` (needs ``tensor > 1``); ``interleave`` chunks per pipeline device (1:
    plain 1F1B; more needs ``pipeline > 1``); ``overlap`` of the data-parallel traffic with the
    compute; ``attention`` one of ``ATTENTION`` (``"fused"``: no score matrix kept)."""

    data: int
    tensor: int
    pipeline: int
    zero: int = 0
    microbatch: int = 1
    recompute: str = "full"
    sequence_parallel: bool = False
    interleave: int = 1
    overlap: bool = False
    attention: str = "materialized"

    def __post_init__(self):
        for name in ("data", "tensor", "pipeline", "microbatch", "interleave"):
            checks.positive_int(name, getattr(self, name))
        checks.one_of("zero", self.zero, (0, 1, 2, 3))
        if self.recompute not in RECOMPUTE:  # True == 1: refuse bools before comparing
            raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got "
                             f"{self.recompute!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {list(ATTENTION)}, got "
                             f"{self.attention!r}")
        for name in ("sequence_parallel", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence_parallel splits the tensor group's replicated regions: "
                             "it needs tensor > 1, got tensor=1")
        if self.interleave > 1 and self.pipeline == 1:
            raise ValueError(f"interleave={self.interleave} chunks need a pipeline "
                             "(pipeline > 1), got pipeline=1")

    @property
    def gpus(self) -> int:
        return self.data * self.tensor * self.pipeline

    @property
    def label(self) -> str:
        """A short description, e.g. ``'d8 t4 p2 ZeRO 1 b1 recompute full, sp, v2, overlap'``."""
        extras = [f"recompute {self.recompute}"] + ["sp"] * self.sequence_parallel + (
            [f"v{self.interleave}"] if self.interleave > 1 else []) + ["overlap"] * self.overlap + (
            ["fused attention"] if self.attention == "fused" else [])
        return (f"d{self.data} t{self.tensor} p{self.pipeline} ZeRO {self.zero} "
                f"b{self.microbatch} " + ", ".join(extras))


@dataclass(frozen=True)
class Memory:
    """Bytes one device holds (the first pipeline stage)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    working: float = 0.0  # ZeRO 3: gathered weights (this block and the next) and its gradient

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.working


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step and its parts; ``tflops_per_gpu``: the FLOPs the plan executes
    (``step_flops``: eq. 3 with full recomputation, as the paper counts) per GPU and second."""

    step_s: float
    compute_s: float
    tensor_s: float
    pipeline_p2p_s: float
    bubble_s: float
    data_s: float
    tflops_per_gpu: float


def layer_parameters(hidden: int, tensor: int = 1) -> int:
    """Parameters one device holds of one block split ``tensor`` ways, as
    ``accel.parallel.megatron.shard`` splits it: ``(12 h^2 + 7 h) / t`` split, ``6 h`` (two
    LayerNorms, the two output biases) replicated."""
    h, t = checks.positive_int("hidden", hidden), checks.positive_int("tensor", tensor)
    if h % t:
        raise ValueError(f"tensor={t} does not divide hidden={h}")
    return (12 * h * h + 7 * h) // t + 6 * h


def stage_parameters(model: Transformer, plan: Plan) -> int:
    """Parameters of one device of the first stage: ``ceil(l / p)`` blocks and the embeddings
    (the word embedding split over the tensor group, the position embedding replicated)."""
    blocks = math.ceil(model.layers / plan.pipeline)
    return (blocks * layer_parameters(model.hidden, plan.tensor)
            + model.vocab * model.hidden // plan.tensor + model.seq * model.hidden)


def _precision(precision: str) -> tuple[int, int, int]:
    checks.one_of("precision", precision, STATE_BYTES)
    return STATE_BYTES[precision]


def state_bytes(params: float, precision: str = PRECISION, zero: int = 0,
                data: int = 1) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of ``params`` parameters with Adam at
    ``STATE_BYTES[precision]``, ZeRO stage ``zero`` sharding them over ``data`` replicas
    (Rajbhandari et al. 2019: stage 1 the optimizer states, 2 also the gradients, 3 also the
    weights; ``params / data`` each, no padding)."""
    params = checks.positive_int("params", params)
    data = checks.positive_int("data", data)
    checks.one_of("zero", zero, (0, 1, 2, 3))
    per = _precision(precision)
    out = tuple(b * (params / data if i in _SHARDED[zero] else params) for i, b in enumerate(per))
    return out[0], out[1], out[2]


def layer_activations(model: Transformer, plan: Plan) -> tuple[float, float]:
    """(kept, whole): 16-bit bytes one layer keeps for the backward pass per micro-batch under
    ``plan``'s recomputation and sequence parallelism (Korthikanti et al. 2022, Table 2), and
    what it holds while its forward is recomputed (the ``"none"`` row)."""
    s, b, h, a, t = model.seq, plan.microbatch, model.hidden, model.heads, plan.tensor
    fused = plan.attention == "fused"
    sbh, attn = s * b * h, (4 * a / (h * t) if fused else 5 * a * s / (h * t))
    if plan.sequence_parallel:
        whole, selective, inputs = sbh * (34 / t + attn), 34 * sbh / t, 2 * sbh / t
    else:
        whole, selective, inputs = sbh * (10 + 24 / t + attn), sbh * (10 + 24 / t), 2 * sbh
    if fused:  # nothing quadratic to drop: selective keeps what none keeps
        selective = whole
    kept = {"none": whole, "selective": selective, "full": inputs}[plan.recompute]
    return kept, whole


def _block_flops(model: Transformer, batch: int, recompute: str,
                 attention: str = "materialized") -> float:
    """One block's FLOPs on ``batch`` sequences: ``24 b s h^2 (1 + s / 6h)`` per pass, 3 passes
    (4 with full recomputation), plus attention's core ``4 b s^2 h`` again with selective, unless
    attention is fused (nothing to rerun; its own recompute of the scores is not charged)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {recompute!r}")
    checks.one_of("attention", attention, ATTENTION)
    passes = 4 if recompute == "full" else 3
    sq = batch * model.seq ** 2 * model.hidden
    core = 4 * sq if recompute == "selective" and attention == "materialized" else 0
    return layer_flops(batch, model.seq, model.hidden, passes=passes) + core


def _logit_flops(model: Transformer, batch: int) -> float:
    """The logit layer's ``6 b s h V`` (forward and backward, never recomputed)."""
    return 6 * checks.positive_int("batch", batch) * model.seq * model.hidden * model.vocab


def stage_state_bytes(layer_params: Sequence[int], balance: Sequence[int],
                      precision: str = PRECISION, zero: int = 0,
                      data: int = 1) -> list[tuple[float, float, float]]:
    """(weights, gradients, optimizer) bytes of each stage of any layered model: layer ``i``
    has ``layer_params[i]`` parameters, stage ``j`` the next ``balance[j]`` layers."""
    sizes = [checks.positive_int("balance entry", k) for k in balance]
    if sum(sizes) != len(layer_params):
        raise ValueError(f"balance {list(balance)} covers {sum(sizes)} layers, but "
                         f"layer_params lists {len(layer_params)}")
    out, start = [], 0
    for k in sizes:
        out.append(state_bytes(sum(layer_params[start:start + k]), precision, zero, data))
        start += k
    return out


def step_flops(model: Transformer, batch: int, recompute: str = "full",
               attention: str = "materialized") -> float:
    """FLOPs one step on ``batch`` sequences executes (eq. 3 with full recomputation)."""
    return (model.layers * _block_flops(model, batch, recompute, attention)
            + _logit_flops(model, batch))


def microbatches(plan: Plan, batch: int) -> int:
    """``m = B / (d b)``; ``ValueError`` if the global batch does not split so."""
    per = plan.data * plan.microbatch
    if checks.positive_int("batch", batch) % per:
        raise ValueError(f"batch={batch} does not split into data={plan.data} replicas of "
                         f"micro-batches of {plan.microbatch} (needs a multiple of {per})")
    return batch // per


def dp_bytes(params: int, data: int, zero: int, microbatches: int = 1,
             precision: str = PRECISION) -> float:
    """Bytes one device sends per step for the data-parallel traffic of ``params`` parameters
    over ``data`` replicas (ring collectives, ``(d - 1) / d`` of the tensor per reduce-scatter
    or all-gather): ZeRO 0 an all-reduce of the gradients; ZeRO 1 a reduce-scatter of the
    gradients and an all-gather of the weights; ZeRO 2 a reduce-scatter per micro-batch and one
    all-gather; ZeRO 3 per micro-batch two all-gathers and a reduce-scatter. Gradients move at
    the gradients' bytes of ``STATE_BYTES[precision]``, weights at the weights'."""
    params, data = checks.positive_int("params", params), checks.positive_int("data", data)
    m = checks.positive_int("microbatches", microbatches)
    checks.one_of("zero", zero, (0, 1, 2, 3))
    w, g, _ = _precision(precision)
    rs, ag = BUS_FACTORS["reduce_scatter"](data), BUS_FACTORS["all_gather"](data)
    per_param = {0: rs * g + ag * g, 1: rs * g + ag * w, 2: m * rs * g + ag * w,
                 3: m * (rs * g + 2 * ag * w)}[zero]
    return per_param * params


def _check(model: Transformer, cluster: Cluster | None, plan: Plan, batch: int) -> int:
    if cluster is not None and plan.gpus != cluster.gpus:
        raise ValueError(f"plan data={plan.data} x tensor={plan.tensor} x pipeline="
                         f"{plan.pipeline} = {plan.gpus} GPUs, but the cluster has {cluster.gpus}")
    if model.heads % plan.tensor:
        raise ValueError(f"tensor={plan.tensor} does not divide heads={model.heads}")
    if plan.pipeline > model.layers:
        raise ValueError(f"pipeline={plan.pipeline} stages for {model.layers} layers")
    m = microbatches(plan, batch)
    if plan.interleave > 1:
        p, v = plan.pipeline, plan.interleave
        if model.layers % (p * v):
            raise ValueError(f"interleave={v} x pipeline={p} chunks do not split "
                             f"{model.layers} layers evenly")
        if m % p:  # Megatron-LM's interleaved schedule refuses it with its default group size
            raise ValueError(f"interleave={v} needs the micro-batches ({m}) to be a multiple "
                             f"of pipeline={p}")
    return m


def memory_per_device(model: Transformer, plan: Plan, batch: int,
                      precision: str = PRECISION) -> Memory:
    """Bytes one device of the first stage holds under ``plan`` for a global ``batch``."""
    m = _check(model, None, plan, batch)
    w, g, o = state_bytes(stage_parameters(model, plan), precision, plan.zero, plan.data)
    kept, whole = layer_activations(model, plan)
    p, v = plan.pipeline, plan.interleave
    in_flight = stash_microbatches("1f1b", m, p) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    acts = in_flight * math.ceil(model.layers / p) * kept
    acts += whole if plan.recompute == "full" else 0.0
    scale = _precision(precision)[0] / 2  # the formulas count 16-bit activations
    working = 0.0
    if plan.zero == 3 and plan.data > 1:
        wb, gb, _ = _precision(precision)
        working = (2 * wb + gb) * layer_parameters(model.hidden, plan.tensor)
    return Memory(w, g, o, acts * scale, working)


def _bandwidth(cluster: Cluster, group: int, span: int) -> float:
    """A group of ``group`` GPUs spaced ``span`` apart in rank order stays in a node if it fits."""
    inside = group * span <= cluster.gpus_per_node
    return cluster.intra_node_bps if inside or group == 1 else cluster.inter_node_bps


def step_time(model: Transformer, cluster: Cluster, plan: Plan, batch: int,
              precision: str = PRECISION, utilization: float = UTILIZATION) -> StepTime:
    """Modelled seconds of one step (ranks ordered tensor, then data, then pipeline)."""
    m = _check(model, cluster, plan, batch)
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    t, p, d, b, v = plan.tensor, plan.pipeline, plan.data, plan.microbatch, plan.interleave
    itemsize = _precision(precision)[0]
    rate = cluster.peak_flops * utilization
    # the slowest stage, the last: its blocks and the logit layer (Megatron-LM keeps it there)
    blocks = math.ceil(model.layers / p)
    stage_flops = (blocks * _block_flops(model, b, plan.recompute, plan.attention)
                   + _logit_flops(model, b))
    stage = stage_flops / t / rate
    forward = (blocks * layer_flops(b, model.seq, model.hidden, passes=1)
               + _logit_flops(model, b) / 3) / t / rate
    act = model.seq * b * model.hidden * itemsize
    reduces = (6 if plan.recompute == "full" else 4) * blocks
    tp = reduces * ring_all_reduce_bytes(act, t) / _bandwidth(cluster, t, 1)
    send = 2 * (act / t) / _bandwidth(cluster, 2, t * d) if p > 1 else 0.0
    slot = (stage + tp) / v + send
    pipe_s = (v * m + p - 1) * slot
    dp = dp_bytes(stage_parameters(model, plan), d, plan.zero, m, precision) / \
        _bandwidth(cluster, d, t)
    if not plan.overlap:
        exposed = dp
    elif plan.zero < 2:  # the reduction runs during the last micro-batch's backward
        exposed = max(0.0, dp - (stage - forward))
    else:  # prefetching hides the per-micro-batch traffic, never more than the compute
        exposed = max(0.0, dp - m * stage)
    total = pipe_s + exposed
    done = step_flops(model, batch, plan.recompute, plan.attention)
    return StepTime(total, m * stage, m * tp, (v * m + p - 1) * send, (p - 1) * slot,
                    exposed, done / (cluster.gpus * total) / 1e12)
