"""The alpha-beta model against hand-worked numbers."""

import math

import numpy as np
import pytest

from accel.costmodel import collectives as cost
from accel.costmodel import fit as fitting


def test_terms_by_hand():
    # one-port links: both terms count the messages on the critical path (Thakur et al. 2005)
    assert cost.terms("ring", 4) == (6.0, 1.5)
    assert cost.terms("one_device", 4) == (6.0, 6.0)   # 3 in to the root, then 3 out
    assert cost.terms("direct", 4) == (3.0, 3.0)       # 3 out while 3 come in
    # binary tree, n = 4: 3 -> 1 (1), then 2 -> 0 and 1 -> 0 in turn (2, 3)... up in 2
    # message times (2 and 3 arrive at 0 at 1 and 2), down: 0 -> 1, 0 -> 2 and 1 -> 3 (4)
    assert cost.tree_path(4) == 4 and cost.terms("tree", 4) == (4.0, 4.0)
    # n = 8: each level's parent takes two children in turn: 4 up, 4 down
    assert cost.tree_path(8) == 8
    assert cost.terms("binomial", 8) == (6.0, 6.0)     # 3 rounds up, 3 down
    assert cost.terms("binomial", 5) == (6.0, 6.0)     # ceil(log2 5) = 3
    assert cost.terms("halving_doubling", 8) == (6.0, 1.75)
    # MPICH's non-power-of-two form: (2 floor(log2 n) + 2) alpha + (2 (p-1)/p + 2) S beta
    assert cost.terms("halving_doubling", 6) == (6.0, 2 * 3 / 4 + 2)
    assert cost.terms("tree", 2) == (2.0, 2.0)
    assert cost.terms("ring", 1) == (0.0, 0.0)
    # halving-doubling: the ring's factor, fewer steps: never slower for a power of two
    for n in (2, 4, 8, 64):
        hd, ring = cost.terms("halving_doubling", n), cost.terms("ring", n)
        assert hd[1] == ring[1] and hd[0] <= ring[0]
        assert cost.crossover_bytes("halving_doubling", "ring", n, 1e-5, 1e9) == math.inf


def test_times_crossover_and_bandwidths_by_hand():
    # ring, n = 4, 1 MB at 1 GB/s, 10 us: 6 * 10 us + 1.5 * 1 ms = 1.56 ms
    assert cost.allreduce_time(1e6, 4, "ring", 10e-6, 1e9) == pytest.approx(1.56e-3)
    # tree (4 alpha + 4 S/bw) = ring (6 alpha + 1.5 S/bw) at S = 2 alpha bw / 2.5
    assert cost.crossover_bytes("tree", "ring", 4, 10e-6, 1e9) == pytest.approx(2e4 / 2.5)
    assert cost.crossover_bytes("ring", "ring", 4, 10e-6, 1e9) == math.inf
    assert cost.algorithm_bandwidth(1e6, 1e-3) == pytest.approx(1e9)
    assert cost.bus_bandwidth(1e6, 1e-3, 4) == pytest.approx(1.5e9)
    assert cost.bus_bandwidth(1e6, 1e-3, 4, "all_gather") == pytest.approx(0.75e9)
    assert cost.bus_bandwidth(1e6, 1e-3, 4, "all_to_all") == pytest.approx(0.75e9)


def test_fit_recovers_a_line():
    sizes = np.array([4e3, 6.4e4, 1e6, 1.6e7])
    a, bw = fitting.fit_alpha_beta(sizes, 2e-3 + sizes / 5e8)
    assert a == pytest.approx(2e-3) and bw == pytest.approx(5e8)
    # relative error: the small sizes fix alpha even when a big one is off by 20%
    a, bw = fitting.fit_alpha_beta(sizes, 2e-3 + sizes / 5e8 * np.array([1, 1, 1, 1.2]))
    assert a == pytest.approx(2e-3, rel=0.05)
    # noise that would make the intercept negative: clipped to 0, bandwidth through the origin
    a, bw = fitting.fit_alpha_beta([1e6, 2e6], [1e-3, 3e-3])
    # (the line through both points has alpha = -1 ms); by hand: bw = sum(x^2/t^2) / sum(x/t)
    # = (1e18 + 4e18/9) / (1e9 + 2e9/3) = 13e9/15
    assert a == 0.0 and bw == pytest.approx(13e9 / 15)
    with pytest.raises(ValueError, match="at least 2"):
        fitting.fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError, match="does not grow"):
        fitting.fit_alpha_beta([1.0, 2.0], [2.0, 1.0])


def test_joint_fit_recovers_call_alpha_and_bandwidth():
    # n = 4: one_device 6 steps / 6 S, tree 4 / 4 S, ring 6 / 1.5 S (terms by hand above);
    # times made from call 1 ms, alpha 0.1 ms, 1 GB/s
    pts = [(alg, 4, s, 1e-3 + st * 1e-4 + f * s / 1e9)
           for alg, st, f in (("one_device", 6, 6), ("tree", 4, 4), ("ring", 6, 1.5))
           for s in (1e3, 1e5, 1e7)]
    fit = fitting.fit_steps_bytes(pts)
    assert fit[:3] == pytest.approx((1e-3, 1e-4, 1e9)) and fit.rel_error < 1e-9
    # the same times read as a shared medium (factor 2 (n-1) = 6 for all three) fit worse
    assert fitting.fit_steps_bytes(pts, medium="shared").rel_error > 0.05
    # a model without any call cost: the negative intercept a noisy fit wants is held at 0
    pts = [(alg, 4, s, st * 1e-4 + f * s / 1e9) for alg, st, f in
           (("tree", 4, 8), ("ring", 6, 1.5)) for s in (1e3, 1e7)]
    pts[0] = ("tree", 4, 1e3, 0.9 * pts[0][3])
    call, alpha, bw, _ = fitting.fit_steps_bytes(pts)
    assert call == 0.0 and alpha > 0 and bw > 0
    with pytest.raises(ValueError, match="two algorithms"):
        fitting.fit_steps_bytes([("ring", 4, 1e3, 1.0), ("ring", 4, 1e4, 2.0)])
    with pytest.raises(ValueError, match="must be"):
        fitting.fit_steps_bytes([("ring", 4, 1e3)])
    with pytest.raises(ValueError, match="algorithm must be one of"):
        fitting.fit_steps_bytes([("star", 4, 1e3, 1.0)] * 3)


def test_shared_medium_counts_every_message_and_byte_sent():
    # total bytes sent, from the counting module (chapter 11), over S: the shared factor
    from accel.collectives import all_reduce_bytes_per_device

    messages = {  # by hand: all messages of all devices
        "one_device": lambda n: 2 * (n - 1),   # n-1 to the root, n-1 back
        "direct": lambda n: n * (n - 1),       # every device to every other
        "ring": lambda n: 2 * (n - 1) * n,     # 2 (n-1) steps, every device sends in each
        "tree": lambda n: 2 * (n - 1),         # every non-root: one up, one down
        "binomial": lambda n: 2 * (n - 1),
        "halving_doubling": lambda n: 2 * n * (n.bit_length() - 1),  # n a power of two
    }
    for n in (2, 4, 8):
        for alg in cost.ALGORITHMS:
            total = sum(all_reduce_bytes_per_device(1024 * n, n, alg, 4)) / (1024 * n)
            assert cost.terms(alg, n, "shared") == (messages[alg](n), total)
    # same bytes, fewer messages: on a shared medium tree and one_device never lose to the ring
    assert cost.crossover_bytes("tree", "ring", 4, 1e-3, 1e8, "shared") == math.inf
    assert cost.crossover_bytes("one_device", "ring", 4, 1e-3, 1e8, "shared") == math.inf
    with pytest.raises(ValueError, match="medium must be one of"):
        cost.terms("ring", 4, "ether")


def test_measured_crossover_by_hand():
    # a faster at 1e3 (ratio 1/2), slower at 1e5 (ratio 2): log ratio crosses 0 half-way in
    # log size, at 1e4
    assert fitting.measured_crossover([1e3, 1e5], [1.0, 4.0], [2.0, 2.0]) == pytest.approx(1e4)
    assert fitting.measured_crossover([1e5, 1e3], [4.0, 1.0], [2.0, 2.0]) == pytest.approx(1e4)
    assert fitting.measured_crossover([1e3, 1e5], [3.0, 4.0], [2.0, 2.0]) == 0.0
    assert fitting.measured_crossover([1e3, 1e5], [1.0, 1.0], [2.0, 2.0]) == math.inf
    with pytest.raises(ValueError, match="equally many"):
        fitting.measured_crossover([1e3], [1.0, 2.0], [1.0])


def test_parameter_servers_packing_local_sgd_overlap_by_hand():
    # 16 workers, 100 bytes, 1 byte/s, no latency: 1 ps carries 1600 each way
    assert cost.sharded_ps_time(100, 16, 1, 0.0, 1.0) == 3200
    assert cost.sharded_ps_time(100, 16, 16, 0.0, 1.0) == 200
    assert cost.sharded_ps_time(100, 16, 32, 0.0, 1.0) == 200  # the worker's link then limits
    # pipelined pieces: a full-duplex link receives and sends at once
    assert cost.sharded_ps_time(100, 16, 16, 1.0, 1.0, pipelined=True) == 2 + 100
    assert cost.sharded_ps_time(100, 16, 1, 0.0, 1.0, pipelined=True) == 1600
    # 3 tensors of 10 bytes, n = 2 ring (2 latencies + 1 x S/bw): unpacked 3 x (2 + 10),
    # one bucket 2 + 30
    assert cost.packed_time([10, 10, 10], 0, 2, "ring", 1.0, 1.0) == 36
    assert cost.packed_time([10, 10, 10], 100, 2, "ring", 1.0, 1.0) == 32
    assert cost.packed_time([10, 10, 10], 20, 2, "ring", 1.0, 1.0) == (2 + 20) + (2 + 10)
    assert cost.local_sgd_step_time(1.0, 0.5, 4) == 1.125
    assert cost.overlapped_step_time(1.0, 2.0, 3.0, 1) == 6.0
    assert cost.overlapped_step_time(1.0, 2.0, 3.0, 4) == 1.0 + 3.0 + 0.5


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="algorithm"):
        cost.terms("butterfly", 4)
    with pytest.raises(ValueError, match="n"):
        cost.terms("ring", 0)
    with pytest.raises(ValueError, match="collective"):
        cost.bus_bandwidth(1, 1, 2, "scatter")


def test_two_level_time_by_hand():
    """2 nodes of 4 GPUs, 800 bytes; inside 1 s per message and 100 bytes/s, between 10 s and
    10 bytes/s per adapter (4 adapters: 40 bytes/s per node)."""
    args = (800, 2, 4, 1.0, 100.0, 10.0, 10.0)
    # flat ring over 8: 14 steps of 10 s + 2 * 7/8 * 800 / min(100, 40) = 140 + 35
    assert cost.two_level_time(*args, scheme="flat_ring") == pytest.approx(175.0)
    # inside: 6 steps of 1 s + 2 * 3/4 * 800 / 100 = 18; between: 4 rings of 200 bytes over
    # 2 nodes, side by side: 2 steps of 10 s + 2 * 1/2 * 200 / 10 = 40
    assert cost.two_level_time(*args, scheme="hierarchical") == pytest.approx(58.0)
    # one node: a ring inside it either way; one GPU per node: a ring between the nodes
    for scheme in cost.TWO_LEVEL:
        assert cost.two_level_time(800, 1, 4, 1.0, 100.0, 10.0, 10.0, scheme) == \
            pytest.approx(18.0)
    assert cost.two_level_time(800, 4, 1, 1.0, 100.0, 10.0, 10.0, "hierarchical") == \
        pytest.approx(cost.allreduce_time(800, 4, "ring", 10.0, 10.0))
    # pipelined: the latencies still add up (6 x 1 s + 2 x 10 s), the bandwidth term is the
    # slower link's load: max(2 * 3/4 * 800 / 100, 2 * 1/2 * 200 / 10) = max(12, 20)
    assert cost.two_level_time(*args, scheme="hierarchical_pipelined") == pytest.approx(46.0)
    assert cost.two_level_time(800, 4, 1, 1.0, 100.0, 10.0, 10.0, "hierarchical_pipelined") == \
        pytest.approx(cost.allreduce_time(800, 4, "ring", 10.0, 10.0))
    # a node's adapters: the flat ring's 8-GPU ring bytes, 2 * 7/8 * 800; the 2-D schemes' ring
    # over 2 nodes of the node's 4 shares of 200: 4 * 2 * 1/2 * 200 = 800
    assert cost.network_bytes_per_node(800, 2, 4, "flat_ring") == pytest.approx(1400.0)
    for scheme in ("hierarchical", "hierarchical_pipelined"):
        assert cost.network_bytes_per_node(800, 2, 4, scheme) == pytest.approx(800.0)
    assert cost.network_bytes_per_node(800, 1, 4, "flat_ring") == 0.0
    with pytest.raises(ValueError, match="scheme must be one of"):
        cost.two_level_time(*args, scheme="torus")
    with pytest.raises(ValueError, match="scheme must be one of"):
        cost.network_bytes_per_node(800, 2, 4, "torus")
    with pytest.raises(ValueError, match="nodes"):
        cost.two_level_time(800, 0, 4, 1.0, 100.0, 10.0, 10.0)


def test_collective_time_by_hand():
    """One-port links, S = 400 bytes over 4 devices, 1 s per message, 100 bytes/s: all-gather,
    reduce-scatter (a ring of 3 steps of S/4) and all-to-all (3 rounds, S/4 to each partner)
    cost 3 + 300/100 = 6 s; the all-reduce is the ring's, 6 steps + 1.5 S / bw."""
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert cost.collective_time(name, 400, 4, 1.0, 100.0) == pytest.approx(6.0)
        assert cost.COLLECTIVES[name](4)[1] == pytest.approx(cost.BUS_FACTORS[name](4))
    assert cost.collective_time("all_reduce", 400, 4, 1.0, 100.0) == \
        pytest.approx(cost.allreduce_time(400, 4, "ring", 1.0, 100.0)) == pytest.approx(12.0)
    # ZeRO-3 / FSDP: two all-gathers and a reduce-scatter send 1.5 times the all-reduce's bytes
    assert (2 * cost.collective_time("all_gather", 1e9, 64, 0.0, 1e9)
            + cost.collective_time("reduce_scatter", 1e9, 64, 0.0, 1e9)) == \
        pytest.approx(1.5 * cost.collective_time("all_reduce", 1e9, 64, 0.0, 1e9))
    assert cost.collective_time("all_to_all", 400, 1, 1.0, 100.0) == 0.0
    with pytest.raises(ValueError, match="collective must be one of"):
        cost.collective_time("gather", 400, 4, 1.0, 100.0)


def test_link_spec_reads_both_tables():
    from accel.costmodel.hardware import LINKS
    assert cost.link_spec("NVLink 4 (H100, per GPU)") is LINKS["NVLink 4 (H100, per GPU)"]
    # B200: 1.8 TB/s both directions per GPU (HGX B200 specifications): 900 GB/s each way
    assert cost.link_spec("NVLink 5 (B200, per GPU)").value == 900.0
    # 800 Gb/s = 100 GB/s; MI300X: 7 links x 128 GB/s both ways / 2
    assert cost.link_spec("800 Gb/s network (XDR / ConnectX-8)").value == 800 / 8
    assert cost.link_spec("Infinity Fabric (MI300X, per GPU)").value == 7 * 128 / 2
    assert not set(cost.CURRENT_LINKS) & set(LINKS)
    with pytest.raises(ValueError, match="link must be one of"):
        cost.link_spec("NVLink 9")


def test_all_to_all_time_is_the_one_port_direct_model():
    s, n, alpha, bw = 8e6, 4, 1e-5, 1e9
    nbytes = cost.BUS_FACTORS["all_to_all"](n) * s  # 6e6: three quarters of S leave each device
    assert cost.all_to_all_time(nbytes, n, alpha, bw) == pytest.approx(3e-5 + 6e-3)
    assert cost.all_to_all_time(0, 1, alpha, bw) == 0.0
    # an even exchange: equal to collective_time of the whole array S
    assert cost.all_to_all_time(nbytes, n, alpha, bw) == pytest.approx(
        cost.collective_time("all_to_all", s, n, alpha, bw))
    with pytest.raises(ValueError, match="bandwidth_bps must be a number > 0"):
        cost.all_to_all_time(1.0, 2, alpha, 0)
