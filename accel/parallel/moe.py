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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from accel import checks
from accel.collectives import all_to_all, check_devices, place

__all__ = ["Routing", "capacity_of", "route", "load_balancing_loss", "load_imbalance",
           "moe_layer", "moe_layer_sharded"]


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
    (Switch Transformer's capacity, times ``k`` for top-``k``)."""
    tokens = checks.positive_int("tokens", tokens)
    num_experts = checks.positive_int("num_experts", num_experts)
    checks.one_of("k", k, (1, 2))
    factor = checks.positive_number("capacity_factor", capacity_factor)
    return math.ceil(factor * k * tokens / num_experts)


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
    tokens whose first choice is ``e``, ``P_e`` the mean gate probability of ``e``. It is 1 when
    both are uniform; its gradient (through ``P_e``) pushes probability away from busy experts."""
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
    tokens, k = routing.expert.shape
    kept = np.argwhere(routing.slot >= 0)  # (t, j) pairs
    idx = np.stack([kept[:, 0], routing.expert[kept[:, 0], kept[:, 1]],
                    routing.slot[kept[:, 0], kept[:, 1]]], axis=1) if len(kept) else \
        np.zeros((0, 3), int)
    shape = [tokens, num_experts, routing.capacity]
    chosen = tf.gather(probs, routing.expert, batch_dims=1)  # [T, k]
    weights = chosen / tf.reduce_sum(chosen, axis=1, keepdims=True) if k == 2 else chosen
    w_kept = tf.gather_nd(weights, kept) if len(kept) else tf.zeros([0], probs.dtype)
    dispatch = tf.scatter_nd(idx, tf.ones([len(idx)], probs.dtype), shape)
    combine = tf.scatter_nd(idx, w_kept, shape)
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
