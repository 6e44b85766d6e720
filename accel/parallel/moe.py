"""A mixture-of-experts layer (top-1 as in Switch Transformer, Fedus et al. 2021,
arXiv:2101.03961; top-2 as in GShard, Lepikhin et al. 2020, arXiv:2006.16668), on one device and
with its experts spread over several devices, tokens sent to them and back with
``accel.collectives.all_to_all``.

A gate (``x @ gate_w``, softmax) scores the ``E`` experts for each token; each token goes to its
``k`` best. Each expert takes at most ``capacity`` tokens per group (``capacity_of``); the choices
beyond it are DROPPED (the token's output gets nothing from that expert; a residual connection
around the layer would carry it). Which token gets which slot is ``route``, a pure rule over the
gate's probabilities: all first choices in token order, then all second choices. A kept choice is
weighted by its probability (top-1) or by its probability over the sum of the token's top-2
probabilities (top-2).

Expert ``e`` is a two-layer ReLU network ``relu(x w1) w2``. On ``n`` devices, device ``i`` holds
experts ``i E/n .. (i+1) E/n - 1`` and one group of tokens (its part of the batch); each group is
routed with its own capacity, exactly as the one-device layer does group by group.

For a Keras model: ``MoE(num_experts, hidden, devices, k, capacity_factor, activation,
aux_loss_weight)`` is the same layer as a Keras layer (experts with biases and any activation,
their variables created on their devices, the routing by ``route``, the load-balancing loss
added with ``add_loss``), to put where a transformer block has its MLP and train with Keras's
``compile`` / ``fit``.

Expert parallelism times data parallelism (``expert_layout``, ``moe_layer_ep_dp``): ``n`` devices
as ``n / ep`` groups of ``ep`` consecutive devices; each group holds all ``E`` experts (``E / ep``
per device) and routes its own tokens among its devices only; a device's experts are copies of
the same experts on the devices at the same place in the other groups, whose gradients are
summed across those copies (the expert-data-parallel all-reduce). ``token_matrix`` counts the
routed choices each device sends to each device.

Routing beyond capacity: ``dropless_layer`` (no capacity, no drops: ``tf.dynamic_partition`` by
expert and one matmul per expert), ``dropless_sharded`` (the same with experts on several
devices, an uneven all-to-all each way, its sent bytes counted from the tensors sent),
``router_z_loss`` (ST-MoE, Zoph et al. 2022, arXiv:2202.08906), ``expert_choice_layer``
(Zhou et al. 2022, arXiv:2202.09368: each expert picks its top-``C`` tokens) and the
auxiliary-loss-free balancing of DeepSeek-V3 (arXiv:2412.19437, section 2.1.2; Wang et al.
2024, arXiv:2408.15664): a per-expert bias added to the scores for the top-``k`` selection only
(``top_k_route(probs, k, bias)``), moved by ``update_bias`` after each step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import keras
import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import all_to_all, check_devices, on_device, place
from accel.devices import normalize_device

__all__ = ["Routing", "capacity_of", "route", "load_balancing_loss", "load_imbalance",
           "moe_layer", "moe_layer_sharded", "MoE", "ExpertLayout", "expert_layout",
           "place_experts", "moe_layer_ep_dp", "token_matrix", "router_z_loss", "top_k_route",
           "expert_load", "update_bias", "dropless_layer", "dropless_sharded",
           "expert_choice_layer"]


@dataclass(frozen=True)
class Routing:
    """Where each token's ``k`` choices go: ``expert[t, j]``, ``slot[t, j]`` (-1: dropped)."""

    expert: np.ndarray
    slot: np.ndarray
    capacity: int

    @property
    def dropped(self) -> int:
        """Choices that found their expert full."""
        return int(np.sum(self.slot < 0))

    def load(self, num_experts: int) -> np.ndarray:
        """Choices each expert was asked to take (kept or not)."""
        return np.bincount(self.expert.ravel(), minlength=num_experts)


def capacity_of(tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert for a group of ``tokens``: ``ceil(capacity_factor * k * tokens / E)``
    (Switch Transformer's capacity, times ``k`` for top-``k``), computed exactly: a float factor
    is read as the decimal it prints as (``1.1`` is 11/10), so 100 tokens, 2 experts, factor 1.1
    give 55 slots, not the 56 that ``math.ceil(1.1 * 100 / 2)`` (55.00000000000001) gives."""
    tokens = checks.positive_int("tokens", tokens)
    num_experts = checks.positive_int("num_experts", num_experts)
    checks.one_of("k", k, (1, 2))
    factor = checks.positive_number("capacity_factor", capacity_factor)
    exact = Fraction(repr(factor)) if isinstance(factor, float) else Fraction(factor)
    return math.ceil(exact * k * tokens / num_experts)


def route(probs: np.ndarray, k: int, capacity: int) -> Routing:
    """The pure routing rule: each token's ``k`` most probable experts (ties: lower index),
    slots given to all first choices in token order, then all second choices; a choice whose
    expert already has ``capacity`` tokens is dropped (slot -1)."""
    probs = np.asarray(probs)
    if probs.ndim != 2:
        raise ValueError(f"probs must be [tokens, experts], got shape {probs.shape}")
    checks.one_of("k", k, (1, 2))
    capacity = checks.positive_int("capacity", capacity)
    expert = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    slot = np.full(expert.shape, -1)
    filled = np.zeros(probs.shape[1], dtype=int)
    for j in range(k):
        for t in range(probs.shape[0]):
            e = expert[t, j]
            if filled[e] < capacity:
                slot[t, j] = filled[e]
                filled[e] += 1
    return Routing(expert, slot, capacity)


def load_balancing_loss(probs, expert_top1, num_experts: int):
    """Switch Transformer's auxiliary loss (eq. 4): ``E * sum_e f_e P_e``, ``f_e`` the share of
    tokens whose first choice is ``e``, ``P_e`` the mean gate probability of ``e``.

    It is exactly 1 whenever ``f`` or ``P`` is uniform (the other then sums to 1). It is NOT
    "1 when balanced and larger otherwise": when the probabilities match the dispatch
    (``P = f``) it is ``E * sum_e f_e**2 >= 1``, equal only at uniform (the sense of the
    paper's "minimized under a uniform distribution"), but ``f`` and ``P`` may disagree and
    take it below 1 (E = 2, three tokens at (0.51, 0.49) and one at (0, 1): 0.8825; its
    smallest value for E = 2 is 7/8; it never goes below ``1/E``, since a token's first choice
    has probability >= 1/E, so ``P_e >= f_e / E``). ``f`` has no gradient; the gradient
    through ``P_e`` is ``E f_e / T`` per token, so it pushes probability away from busy
    experts."""
    f = tf.cast(tf.math.bincount(tf.cast(expert_top1, tf.int32), minlength=num_experts,
                                 maxlength=num_experts), probs.dtype)
    f = f / tf.cast(tf.shape(probs)[0], probs.dtype)
    return num_experts * tf.reduce_sum(f * tf.reduce_mean(probs, axis=0))


def load_imbalance(routing: Routing, num_experts: int) -> float:
    """The busiest expert's first choices over the mean: 1.0 is perfectly balanced."""
    counts = np.bincount(routing.expert[:, 0], minlength=num_experts)
    return float(counts.max() * num_experts / counts.sum())


def _dispatch_combine(probs, routing: Routing, num_experts: int):
    """``dispatch`` [T, E, C] (0/1) and ``combine`` [T, E, C] (the gate weights, differentiable
    in ``probs``) for one group."""
    return _dispatch_combine_of(probs, routing.expert, routing.slot, routing.capacity,
                                num_experts)


def _dispatch_combine_of(probs, expert, slot, capacity, num_experts: int):
    """``_dispatch_combine`` from a routing's arrays or tensors (``capacity`` may be a tensor,
    so it runs inside a ``tf.function``): one-hot of the expert times one-hot of the slot, a
    dropped choice (slot -1) a row of zeros."""
    k = int(expert.shape[1])
    chosen = tf.gather(probs, expert, batch_dims=1)  # [T, k]
    weights = chosen / tf.reduce_sum(chosen, axis=1, keepdims=True) if k == 2 else chosen
    to_expert = tf.one_hot(expert, num_experts, dtype=probs.dtype)  # [T, k, E]
    to_slot = tf.one_hot(slot, capacity, dtype=probs.dtype)  # [T, k, C]
    dispatch = tf.einsum("tje,tjc->tec", to_expert, to_slot)
    combine = tf.einsum("tje,tjc->tec", to_expert * weights[:, :, None], to_slot)
    return dispatch, combine


def _expert(x, w1, w2):
    return tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)


def _check_experts(experts: Sequence, k: int) -> int:
    checks.one_of("k", k, (1, 2))
    if len(experts) < k:
        raise ValueError(f"top-{k} routing needs at least {k} experts, got {len(experts)}")
    return len(experts)


def _gate(x, gate_w, k, capacity_factor, num_experts):
    probs = tf.nn.softmax(tf.matmul(x, gate_w))
    cap = capacity_of(int(x.shape[0]), num_experts, k, capacity_factor)
    routing = route(probs.numpy(), k, cap)
    return probs, routing


def moe_layer(x, gate_w, experts: Sequence, k: int = 1, capacity_factor: float = 1.0,
              groups: int = 1):
    """The layer on the current device (eager): ``x`` [T, d] cut into ``groups`` groups, each
    routed with its own capacity. Returns ``(y, routings)``, one ``Routing`` per group.
    ``experts`` is a list of ``(w1, w2)``."""
    num_experts = _check_experts(experts, k)
    groups = checks.positive_int("groups", groups)
    if x.shape[0] % groups:
        raise ValueError(f"{x.shape[0]} tokens do not split into groups={groups}")
    ys, routings = [], []
    for xg in tf.split(x, groups):
        probs, routing = _gate(xg, gate_w, k, capacity_factor, num_experts)
        dispatch, combine = _dispatch_combine(probs, routing, num_experts)
        inputs = tf.einsum("tec,td->ecd", dispatch, xg)
        outs = tf.stack([_expert(inputs[e], *experts[e]) for e in range(num_experts)])
        ys.append(tf.einsum("tec,ecd->td", combine, outs))
        routings.append(routing)
    return tf.concat(ys, 0), routings


def moe_layer_sharded(xs: Sequence, gate_w, experts: Sequence, devices: Sequence[str],
                      k: int = 1, capacity_factor: float = 1.0):
    """The layer with its experts spread over ``devices`` (expert ``e`` must live on device
    ``e // (E / n)``; the gate ``gate_w`` is copied to every device). ``xs``: one group of
    tokens per device. Dispatch: an all-to-all sends each device's slots for expert ``e`` to
    ``e``'s device; the experts run there on all groups' tokens at once; a second all-to-all
    sends the outputs back, where they are combined. Returns ``(ys, routings)``."""
    devices = check_devices(devices)
    n, num_experts = len(devices), _check_experts(experts, k)
    if num_experts % n:
        raise ValueError(f"{num_experts} experts do not split over {n} devices")
    per = num_experts // n
    gates = place(gate_w, devices)
    sent, combines, routings = [], [], []
    for i, d in enumerate(devices):
        with tf.device(d):
            probs, routing = _gate(xs[i], gates[i], k, capacity_factor, num_experts)
            dispatch, combine = _dispatch_combine(probs, routing, num_experts)
            sent.append(tf.einsum("tec,td->ecd", dispatch, xs[i]))  # [E, C, d]
            combines.append(combine)
            routings.append(routing)
    arrived = all_to_all(sent, devices, split_axis=0, concat_axis=1)  # [E/n, n C, d]
    done = []
    for j, d in enumerate(devices):
        with tf.device(d):
            done.append(tf.stack([_expert(arrived[j][e], *experts[j * per + e])
                                  for e in range(per)]))
    back = all_to_all(done, devices, split_axis=1, concat_axis=0)  # [E, C, d]
    ys = []
    for i, d in enumerate(devices):
        with tf.device(d):
            ys.append(tf.einsum("tec,ecd->td", combines[i], back[i]))
    return ys, routings


# --------------------------------------------------------------------------- as a Keras layer
@keras.saving.register_keras_serializable("accel")
class MoE(keras.layers.Layer):
    """A mixture-of-experts MLP as a Keras layer, its experts spread over ``devices``: put it
    where a transformer block has its MLP (``x + MoE(...)(norm(x))``).

    Input ``(batch, tokens, width)`` or ``(batch, width)``; output the same shape. The tokens
    (all positions of all examples, in order) are cut into ``len(devices)`` equal groups, group
    ``i`` on ``devices[i]`` (the token count must divide; ``ValueError`` when it is known not
    to). On each device: the gate (``x @ gate_kernel``, no bias, softmax over the
    ``num_experts`` experts), the routing of its group by ``route`` (top-``k``, ``k`` 1 or 2,
    ``capacity_of(group tokens, num_experts, k, capacity_factor)`` slots per expert; a choice
    that finds its expert full is dropped, so a token may get nothing: the residual around the
    layer carries it), and its slots packed per expert. An all-to-all
    (``accel.collectives.all_to_all``) sends each expert's slots to the expert's device; expert
    ``e`` (``activation(x w1 + b1) w2 + b2``, width -> ``hidden`` -> width) lives on
    ``devices[e // (num_experts / len(devices))]`` with its variables and computes there,
    forward and backward (``accel.collectives.on_device``); a second all-to-all brings the
    outputs back, where each token sums its experts' outputs weighted by the gate
    (its probability for ``k=1``, over the sum of its two chosen probabilities for ``k=2``), so
    the gate is trained by the loss.

    Switch Transformer's load-balancing loss (``load_balancing_loss``, per group, averaged over
    the groups) times ``aux_loss_weight`` is added with ``add_loss``, so Keras's ``fit`` trains
    with it (``model.losses`` in a loop of your own); ``aux_loss_weight=0`` leaves it out. It
    is added in ``keras.config.floatx()``, the dtype of Keras's compiled losses, which ``fit``
    sums with it (even for a float64 layer).

    The routing rule runs as ``route`` itself, on the host (``tf.numpy_function``): the layer
    cannot be compiled by XLA (``supports_jit`` is False, so ``jit_compile="auto"`` leaves XLA
    off; ``jit_compile=True`` fails), and on a GPU the gate's probabilities make one trip to the
    host per layer and step. The layer holds its own variables on their devices, so there is
    nothing to write back: the model you train is the model you keep. Build the optimizer on
    the model's variables before ``fit`` (``optimizer.build(model.trainable_variables)``), so
    that each expert's optimizer slots sit beside it (built inside ``fit``'s function, Keras
    puts every slot on one device). The gate's variable lives on ``devices[0]``; the layer's
    output is gathered where the caller runs."""

    def __init__(self, num_experts: int, hidden: int, devices: Sequence[str], k: int = 1,
                 capacity_factor: float = 1.0, activation="gelu", aux_loss_weight: float = 0.01,
                 kernel_initializer="glorot_uniform", **kwargs):
        if kwargs.get("name") is None:  # "moe", "moe_1", ... as Keras names its own layers
            uid = keras.backend.get_uid("moe")
            kwargs["name"] = "moe" if uid == 1 else f"moe_{uid - 1}"
        super().__init__(**kwargs)
        self.devices = [normalize_device(d) for d in check_devices(devices)]
        self.num_experts = checks.positive_int("num_experts", num_experts)
        self.hidden = checks.positive_int("hidden", hidden)
        checks.one_of("k", k, (1, 2))
        if num_experts < k:
            raise ValueError(f"top-{k} routing needs at least {k} experts, got {num_experts}")
        if num_experts % len(self.devices):
            raise ValueError(f"num_experts={num_experts} experts do not split over "
                             f"{len(self.devices)} devices: give a multiple of "
                             f"{len(self.devices)}")
        self.k = k
        self.capacity_factor = checks.positive_number("capacity_factor", capacity_factor)
        self.aux_loss_weight = checks.non_negative_number("aux_loss_weight", aux_loss_weight)
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.per_device = num_experts // len(self.devices)
        self.supports_jit = False

    def device_of(self, expert: int) -> str:
        """The device that holds expert ``expert``."""
        return self.devices[expert // self.per_device]

    def build(self, input_shape):
        if len(input_shape) < 2 or input_shape[-1] is None:
            raise ValueError(f"MoE takes (batch, tokens, width) or (batch, width) with a known "
                             f"width, got input shape {tuple(input_shape)}")
        width = int(input_shape[-1])
        with tf.device(self.devices[0]):
            self.gate_kernel = self.add_weight(shape=(width, self.num_experts),
                                               initializer=self.kernel_initializer,
                                               name="gate_kernel")
        self.w1, self.b1, self.w2, self.b2 = [], [], [], []
        for e in range(self.num_experts):
            with tf.device(self.device_of(e)):
                self.w1.append(self.add_weight(shape=(width, self.hidden), name=f"expert{e}_w1",
                                               initializer=self.kernel_initializer))
                self.b1.append(self.add_weight(shape=(self.hidden,), initializer="zeros",
                                               name=f"expert{e}_b1"))
                self.w2.append(self.add_weight(shape=(self.hidden, width), name=f"expert{e}_w2",
                                               initializer=self.kernel_initializer))
                self.b2.append(self.add_weight(shape=(width,), initializer="zeros",
                                               name=f"expert{e}_b2"))

    def _route(self, probs):
        cap = capacity_of(len(probs), self.num_experts, self.k, self.capacity_factor)
        r = route(probs, self.k, cap)
        return r.expert.astype(np.int32), r.slot.astype(np.int32), np.int32(cap)

    def _dispatch(self, tokens):
        """One group on its device: gate, routing, its slots per expert [E, C, width], the
        combine weights [T, E, C] and the group's load-balancing loss."""
        probs = tf.nn.softmax(tf.matmul(tokens, self.gate_kernel.value))
        expert, slot, cap = tf.numpy_function(self._route, [tf.stop_gradient(probs)],
                                              [tf.int32] * 3, stateful=False)
        expert.set_shape([None, self.k])
        slot.set_shape([None, self.k])
        dispatch, combine = _dispatch_combine_of(probs, expert, slot, cap, self.num_experts)
        aux = load_balancing_loss(probs, expert[:, 0], self.num_experts)
        return [tf.einsum("tec,td->ecd", dispatch, tokens), combine, aux]

    def _experts(self, j, arrived):
        """Device ``j``'s experts on the slots sent to them [E/n, n C, width]."""
        outs = []
        for i, x in enumerate(tf.unstack(arrived, self.per_device)):
            e = j * self.per_device + i
            h = self.activation(tf.matmul(x, self.w1[e].value) + self.b1[e].value)
            outs.append(tf.matmul(h, self.w2[e].value) + self.b2[e].value)
        return tf.stack(outs)

    def call(self, x):
        n, width = len(self.devices), x.shape[-1]
        flat = tf.reshape(x, [-1, width])
        if flat.shape[0] is not None and flat.shape[0] % n:
            raise ValueError(f"{flat.shape[0]} tokens (batch x tokens) do not split into "
                             f"{n} equal groups, one per device")
        groups = tf.split(flat, n) if n > 1 else [flat]
        parts = [on_device(self._dispatch, d, g) for g, d in zip(groups, self.devices,
                                                                  strict=True)]
        arrived = all_to_all([p[0] for p in parts], self.devices, split_axis=0, concat_axis=1)
        done = [on_device(lambda a, j=j: self._experts(j, a), d, a)
                for j, (a, d) in enumerate(zip(arrived, self.devices, strict=True))]
        back = all_to_all(done, self.devices, split_axis=1, concat_axis=0)  # [E, C, width]
        ys = [on_device(lambda c, b: tf.einsum("tec,ecd->td", c, b), d, p[1], b)
              for p, b, d in zip(parts, back, self.devices, strict=True)]
        if self.aux_loss_weight:
            aux = self.aux_loss_weight * tf.add_n([p[2] for p in parts]) / n
            self.add_loss(tf.cast(aux, keras.config.floatx()))  # Keras's losses' dtype
        return tf.reshape(tf.concat(ys, 0) if n > 1 else ys[0], tf.shape(x))

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "num_experts": self.num_experts, "hidden": self.hidden,
                "devices": self.devices, "k": self.k, "capacity_factor": self.capacity_factor,
                "activation": keras.activations.serialize(self.activation),
                "aux_loss_weight": self.aux_loss_weight,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}


# --------------------------------------------------------- expert parallelism x data parallelism
@dataclass(frozen=True)
class ExpertLayout:
    """``num_experts`` experts over ``devices`` as ``ep``-way expert parallelism times
    ``len(devices) / ep``-way data parallelism. Device ``i`` is in EP group ``i // ep`` (devices
    ``g ep .. g ep + ep - 1``: consecutive, as one keeps an EP group inside one NVLink node); it
    holds experts ``(i % ep) E / ep .. (i % ep + 1) E / ep - 1`` and sends its tokens only to
    the devices of its own group; the devices at the same place in every group hold copies of
    the same experts and sum their gradients (``expert_dp_group``)."""

    num_experts: int
    devices: tuple
    ep: int

    @property
    def dp(self) -> int:
        """Copies of each expert (the expert-data-parallel size)."""
        return len(self.devices) // self.ep

    @property
    def per_device(self) -> int:
        return self.num_experts // self.ep

    def ep_group(self, i: int) -> list[int]:
        """Indices of the devices device ``i`` exchanges tokens with (itself included)."""
        g = i // self.ep
        return list(range(g * self.ep, (g + 1) * self.ep))

    def experts_on(self, i: int) -> list[int]:
        """The experts device ``i`` holds."""
        r = i % self.ep
        return list(range(r * self.per_device, (r + 1) * self.per_device))

    def expert_dp_group(self, i: int) -> list[int]:
        """Indices of the devices that hold copies of device ``i``'s experts (itself included)."""
        return list(range(i % self.ep, len(self.devices), self.ep))

    def device_of(self, expert: int, source: int) -> int:
        """Index of the device that runs ``expert`` for the tokens of device ``source``."""
        return self.ep_group(source)[0] + expert // self.per_device


def expert_layout(num_experts: int, devices: Sequence[str], ep: int) -> ExpertLayout:
    """An ``ExpertLayout``; ``ValueError`` unless ``ep`` divides the device count and the
    experts split evenly over ``ep`` devices."""
    devices = check_devices(devices)
    num_experts = checks.positive_int("num_experts", num_experts)
    ep = checks.positive_int("ep", ep)
    if len(devices) % ep:
        raise ValueError(f"ep={ep} does not divide the {len(devices)} devices into EP groups")
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over ep={ep} devices")
    return ExpertLayout(num_experts, tuple(devices), ep)


def place_experts(experts: Sequence, layout: ExpertLayout) -> list[list]:
    """One copy of ``experts`` (a list of ``(w1, w2)`` arrays) per EP group, each expert's
    variables created on the device that holds it: ``replicas[g][e]``."""
    if len(experts) != layout.num_experts:
        raise ValueError(f"got {len(experts)} experts for a layout of {layout.num_experts}")
    replicas = []
    for g in range(layout.dp):
        copy = []
        for e, (w1, w2) in enumerate(experts):
            with tf.device(layout.devices[layout.device_of(e, g * layout.ep)]):
                copy.append((tf.Variable(w1), tf.Variable(w2)))
        replicas.append(copy)
    return replicas


def moe_layer_ep_dp(xs: Sequence, gate_w, replicas: Sequence, layout: ExpertLayout, k: int = 1,
                    capacity_factor: float = 1.0):
    """The layer on ``layout``: ``xs[i]`` is device ``i``'s group of tokens; each EP group runs
    ``moe_layer_sharded`` on its own copy of the experts (``replicas[g]``, from
    ``place_experts``). Returns ``(ys, routings)`` in device order."""
    n = len(layout.devices)
    if len(xs) != n:
        raise ValueError(f"got {len(xs)} token groups for {n} devices")
    if len(replicas) != layout.dp or any(len(r) != layout.num_experts for r in replicas):
        raise ValueError(f"replicas must hold {layout.dp} copies of {layout.num_experts} experts")
    ys, routings = [], []
    for g in range(layout.dp):
        idx = layout.ep_group(g * layout.ep)
        y, r = moe_layer_sharded([xs[i] for i in idx], gate_w, replicas[g],
                                 [layout.devices[i] for i in idx], k, capacity_factor)
        ys += y
        routings += r
    return ys, routings


def token_matrix(experts: Sequence, layout: ExpertLayout, kept: Sequence | None = None):
    """``m[i, j]``: the routed choices of device ``i``'s tokens that go to device ``j`` (the
    rows of the dispatch all-to-all; the combine sends the transpose back). ``experts[i]`` holds
    device ``i``'s chosen experts (any shape); ``kept[i]`` (same shape, optional) marks the
    choices that found a slot (``Routing.slot >= 0``): dropped ones are not sent."""
    n = len(layout.devices)
    if len(experts) != n or (kept is not None and len(kept) != n):
        raise ValueError(f"need one array of chosen experts (and of kept flags) per device ({n})")
    m = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        chosen = np.asarray(experts[i]).ravel()
        mask = np.ones(chosen.shape, bool) if kept is None else np.asarray(kept[i]).ravel()
        if chosen.size and (chosen.min() < 0 or chosen.max() >= layout.num_experts):
            raise ValueError(f"device {i} names an expert outside 0..{layout.num_experts - 1}")
        for e in chosen[mask]:
            m[i, layout.device_of(int(e), i)] += 1
    return m


# ------------------------------------------------------------------- routing beyond capacity
def router_z_loss(logits):
    """ST-MoE's router z-loss (Zoph et al. 2022, arXiv:2202.08906): the mean over tokens of
    ``logsumexp(logits)**2``. Softmax ignores a shift of a token's logits; this loss does not,
    so it keeps the logits small (where bfloat16 still resolves them)."""
    logits = tf.convert_to_tensor(logits)
    if logits.shape.rank != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {logits.shape}")
    return tf.reduce_mean(tf.square(tf.reduce_logsumexp(logits, axis=-1)))


def _check_k(k: int, num_experts: int) -> int:
    k = checks.positive_int("k", k)
    if k > num_experts:
        raise ValueError(f"top-{k} routing needs at least {k} experts, got {num_experts}")
    return k


def top_k_route(probs, k: int, bias=None):
    """Each token's ``k`` experts and their weights: the ``k`` largest of ``probs + bias``
    (``tf.math.top_k``: ties go to the lower index; ``bias`` per expert, no gradient, ``None``
    for none), weighted by their UNBIASED probabilities (renormalised over the chosen ``k``
    when ``k > 1``): the bias decides who is chosen, never how much they count (DeepSeek-V3,
    section 2.1.2). Returns ``(expert [T, k] int32, weights [T, k])``."""
    probs = tf.convert_to_tensor(probs)
    if probs.shape.rank != 2:
        raise ValueError(f"probs must be [tokens, experts], got shape {probs.shape}")
    num_experts = int(probs.shape[1])
    k = _check_k(k, num_experts)
    scores = probs
    if bias is not None:
        bias = tf.stop_gradient(tf.cast(bias, probs.dtype))
        if bias.shape != (num_experts,):
            raise ValueError(f"bias must have one value per expert ({num_experts}), got shape "
                             f"{bias.shape}")
        scores = probs + bias
    expert = tf.math.top_k(scores, k).indices
    chosen = tf.gather(probs, expert, batch_dims=1)
    weights = chosen / tf.reduce_sum(chosen, axis=1, keepdims=True) if k > 1 else chosen
    return expert, weights


def expert_load(expert, num_experts: int) -> np.ndarray:
    """Choices each expert received (``expert``: any array of expert indices)."""
    num_experts = checks.positive_int("num_experts", num_experts)
    flat = np.asarray(expert).ravel().astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"expert indices must lie in 0..{num_experts - 1}")
    return np.bincount(flat, minlength=num_experts)


def update_bias(bias, load, rate: float) -> np.ndarray:
    """The auxiliary-loss-free update after a step (Wang et al. 2024, arXiv:2408.15664,
    Algorithm 1; DeepSeek-V3, section 2.1.2): ``bias + rate * sign(mean(load) - load)``: an
    overloaded expert's bias falls by ``rate``, an underloaded one's rises, an exact one's
    stays."""
    bias = np.asarray(bias, dtype=np.float64)
    load = np.asarray(load, dtype=np.float64)
    if bias.ndim != 1 or load.shape != bias.shape:
        raise ValueError(f"bias and load must both be one value per expert, got shapes "
                         f"{bias.shape} and {load.shape}")
    rate = checks.non_negative_number("rate", rate)
    return bias + rate * np.sign(load.mean() - load)


def _by_expert(x, expert, weights, experts: Sequence):
    """Dropless compute on one device: each (token, choice) pair partitioned by its expert
    (``tf.dynamic_partition``), one matmul chain per expert on exactly its tokens, each output
    weighted and summed back into its token's row (``tf.math.unsorted_segment_sum``)."""
    tokens, k = tf.shape(x)[0], int(expert.shape[1])
    choice_token = tf.repeat(tf.range(tokens), k)  # the token of each (token, choice) pair
    flat_w = tf.reshape(weights, [-1])
    parts = tf.dynamic_partition(tf.range(tokens * k), tf.reshape(expert, [-1]), len(experts))
    outs, rows = [], []
    for e, pairs in enumerate(parts):
        t = tf.gather(choice_token, pairs)
        outs.append(_expert(tf.gather(x, t), *experts[e]) * tf.gather(flat_w, pairs)[:, None])
        rows.append(t)
    return tf.math.unsorted_segment_sum(tf.concat(outs, 0), tf.concat(rows, 0), tokens)


def dropless_layer(x, gate_w, experts: Sequence, k: int = 1, bias=None):
    """The layer with no capacity: every token reaches its ``k`` experts (``top_k_route``,
    optionally with a balancing ``bias``), each expert runs one matmul chain on exactly its
    tokens. Returns ``(y, expert [T, k], logits)``; gradients reach ``x``, the gate and every
    expert through the gate's weights."""
    num_experts = len(experts)
    k = _check_k(k, num_experts)
    logits = tf.matmul(x, gate_w)
    if logits.shape[-1] != num_experts:
        raise ValueError(f"gate_w scores {logits.shape[-1]} experts, got {num_experts}")
    expert, weights = top_k_route(tf.nn.softmax(logits), k, bias)
    return _by_expert(x, expert, weights, experts), expert, logits


def dropless_sharded(xs: Sequence, gate_w, experts: Sequence, devices: Sequence[str], k: int = 1,
                     bias=None):
    """``dropless_layer`` with expert ``e`` on ``devices[e // (E / n)]`` and ``xs[i]`` the
    tokens of ``devices[i]``. Each device routes its tokens, partitions its (token, choice)
    pairs by destination device and sends each part there (an uneven all-to-all: the parts
    differ in size); the destination runs its experts and sends the outputs back, where they are
    weighted and summed. Dropless routing does not depend on how tokens are grouped, so this
    equals ``dropless_layer`` on all tokens at once. Returns ``(ys, experts_per_device, sent)``
    with ``sent[i, j]`` the bytes of activations device ``i`` sent to device ``j != i`` in the
    dispatch (from the shapes of the tensors sent; the combine sends as many back, and each
    choice's expert index, one int32, travels with it)."""
    devices = check_devices(devices)
    n, num_experts = len(devices), len(experts)
    k = _check_k(k, num_experts)
    if num_experts % n:
        raise ValueError(f"{num_experts} experts do not split over {n} devices")
    if len(xs) != n:
        raise ValueError(f"got {len(xs)} token groups for {n} devices")
    per = num_experts // n
    sent = np.zeros((n, n), dtype=np.int64)
    inbox = [[None] * n for _ in range(n)]  # inbox[j][i]: (tokens, local experts) from i
    state = []
    for i, d in enumerate(devices):
        with tf.device(d):
            probs = tf.nn.softmax(tf.matmul(xs[i], gate_w))
            expert, weights = top_k_route(probs, k, bias)
            flat_e = tf.reshape(expert, [-1])
            pair_token = tf.repeat(tf.range(tf.shape(xs[i])[0]), k)
            pairs = tf.dynamic_partition(tf.range(tf.size(flat_e)), flat_e // per, n)
            out_rows = [tf.gather(xs[i], tf.gather(pair_token, p)) for p in pairs]
            out_local = [tf.gather(flat_e, p) - j * per for j, p in enumerate(pairs)]
        state.append((expert, weights, pair_token, pairs))
        for j, dj in enumerate(devices):
            with tf.device(dj):  # the send: a copy placed on the destination
                rows, local = tf.identity(out_rows[j]), tf.identity(out_local[j])
            if j != i:
                sent[i, j] += rows.shape[0] * rows.shape[1] * rows.dtype.size
            inbox[j][i] = (rows, local)
    back = [[None] * n for _ in range(n)]  # back[i][j]: outputs for device i's pairs sent to j
    for j, dj in enumerate(devices):
        with tf.device(dj):
            rows = tf.concat([inbox[j][i][0] for i in range(n)], 0)
            local = tf.concat([inbox[j][i][1] for i in range(n)], 0)
            parts = tf.dynamic_partition(tf.range(tf.shape(rows)[0]), local, per)
            outs = [_expert(tf.gather(rows, p), *experts[j * per + e]) for e, p in
                    enumerate(parts)]
            out = tf.dynamic_stitch(parts, outs)  # back in arrival order
            sizes = [tf.shape(inbox[j][i][0])[0] for i in range(n)]
            for i, part in enumerate(tf.split(out, tf.stack(sizes), num=n)):
                back[i][j] = part
    ys = []
    for i, d in enumerate(devices):
        expert, weights, pair_token, pairs = state[i]
        with tf.device(d):  # the combine's receive, then the weighted sum per token
            outs = tf.concat([tf.identity(back[i][j]) for j in range(n)], 0)
            order = tf.concat(pairs, 0)
            w = tf.gather(tf.reshape(weights, [-1]), order)[:, None]
            ys.append(tf.math.unsorted_segment_sum(outs * w, tf.gather(pair_token, order),
                                                   tf.shape(xs[i])[0]))
    return ys, [s[0] for s in state], sent


def expert_choice_layer(x, gate_w, experts: Sequence, capacity_factor: float = 2.0):
    """Expert-choice routing (Zhou et al. 2022, arXiv:2202.09368): the token-to-expert
    probabilities ``S = softmax(x gate_w)`` (over experts, per token), then EACH EXPERT takes
    the ``C = capacity_of(T, E, 1, capacity_factor)`` tokens it scores highest
    (``tf.math.top_k`` of ``S``'s transpose; ties to the lower token index) and weights its
    output for token ``t`` by ``S[t, e]``. Every expert gets exactly ``C`` tokens; a token may get
    several experts or none. Returns ``(y, tokens [E, C])``."""
    num_experts = len(experts)
    tokens = int(x.shape[0])
    cap = capacity_of(tokens, num_experts, 1, capacity_factor)
    if cap > tokens:
        raise ValueError(f"capacity_factor={capacity_factor} asks each expert for {cap} of "
                         f"{tokens} tokens; at most {num_experts} (every expert takes every "
                         f"token)")
    probs = tf.nn.softmax(tf.matmul(x, gate_w))
    if probs.shape[-1] != num_experts:
        raise ValueError(f"gate_w scores {probs.shape[-1]} experts, got {num_experts}")
    gates, chosen = tf.math.top_k(tf.transpose(probs), cap)  # [E, C] each
    outs = [_expert(tf.gather(x, chosen[e]), *experts[e]) * gates[e][:, None]
            for e in range(num_experts)]
    return tf.math.unsorted_segment_sum(tf.concat(outs, 0), tf.reshape(chosen, [-1]),
                                        tokens), chosen
