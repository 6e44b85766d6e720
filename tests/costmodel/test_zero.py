"""ZeRO's formulas against the paper's table and sums worked out by hand."""

import pytest

from accel.costmodel import zero as cm


def test_mixed_precision_matches_the_paper():
    # the paper's example (figure 1): 7.5B parameters, N = 64 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB
    psi, n = 7_500_000_000, 64
    got = [cm.zero_total_bytes(psi, n, s) / 1e9 for s in (0, 1, 2, 3)]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.875], abs=0.06)
    assert [cm.zero_formula(s) for s in (0, 1, 2, 3)] == [
        "16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"]


def test_fp32_by_hand():
    # Ψ = 1000, N = 4: weights 4000, grads 4000, Adam m + v 8000 bytes unsharded
    assert cm.zero_bytes_per_device(1000, 4, 0, "fp32") == {
        "weights": 4000, "grads": 4000, "optimizer": 8000, "total": 16000}
    assert cm.zero_bytes_per_device(1000, 4, 1, "fp32")["total"] == 8000 + 2000
    assert cm.zero_bytes_per_device(1000, 4, 2, "fp32")["total"] == 4000 + 3000
    assert cm.zero_bytes_per_device(1000, 4, 3, "fp32")["total"] == 4000
    assert [cm.zero_formula(s, "fp32") for s in (0, 1, 2, 3)] == [
        "16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"]


def test_padding_rounds_each_shard_up():
    assert cm.shard_elements(10, 4) == 3
    assert cm.zero_bytes_per_device(10, 4, 3, "fp32", pad=True)["weights"] == 12
    assert cm.zero_bytes_per_device(10, 4, 3, "fp32")["weights"] == 10


def test_communication_by_hand():
    # fp32, Ψ = 1000, N = 4: gradient bytes 4000; 2 * 3/4 * 4000 = 6000; stage 3: 9000
    assert [cm.zero_comm_bytes(1000, 4, s, "fp32") for s in (0, 1, 2, 3)] == [
        6000, 6000, 6000, 9000]
    assert cm.zero_comm_bytes(1000, 1, 3, "fp32") == 0


def test_communication_with_accumulation_by_hand():
    # 5 micro-batches: stages 0-1 all-reduce once (6000); stage 2 reduce-scatters per
    # micro-batch, 5 x 3000, and gathers once, 3000; stage 3: 5 x 9000
    assert [cm.zero_comm_bytes_accumulated(1000, 4, s, 5, "fp32") for s in (0, 1, 2, 3)] == [
        6000, 6000, 18000, 45000]
    for s in (0, 1, 2, 3):
        assert cm.zero_comm_bytes_accumulated(1000, 4, s, 1, "fp32") == \
            cm.zero_comm_bytes(1000, 4, s, "fp32")


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 4}, "stage must be one of"),
    ({"stage": True}, "stage must be one of"),
    ({"n": 0}, "n must be an int >= 1"),
    ({"params": -5}, "params must be an int >= 1"),
    ({"precision": "fp8"}, "precision must be one of"),
])
def test_bad_input(kwargs, match):
    args = {"params": 100, "n": 4, "stage": 1, "precision": "fp32"} | kwargs
    with pytest.raises(ValueError, match=match):
        cm.zero_bytes_per_device(**args)


def test_offload_verdict_by_hand():
    # A100 bf16 peak 312e12 at 50% = 156e12 FLOP/s; PCIe 4.0 x16 31.5e9 B/s:
    # break-even tokens = 2 * 156e12 / (6 * 31.5e9) = 1650.8
    t = cm.offload_break_even_tokens("NVIDIA A100", "PCIe 4.0 x16", "bf16")
    assert t == pytest.approx(2 * 156e12 / (6 * 31.5e9))
    small = cm.offload_step(10**9, 512, "NVIDIA A100", "PCIe 4.0 x16", "bf16")
    big = cm.offload_step(10**9, 8192, "NVIDIA A100", "PCIe 4.0 x16", "bf16")
    assert small["transfer_s"] == pytest.approx(2e9 / 31.5e9)
    assert big["compute_s"] == pytest.approx(6e9 * 8192 / 156e12)
    assert (small["bottleneck"], big["bottleneck"]) == ("transfer", "compute")
    with pytest.raises(ValueError, match="utilization must be in"):
        cm.offload_step(10, 10, "NVIDIA A100", "PCIe 4.0 x16", utilization=0)


def test_megatron_table():
    """Megatron Core's distributed-optimizer guide, as written there: bytes per parameter
    without sharding, and with its distributed optimizer (d = data-parallel size), for
    16-bit params and grads, 16-bit params and fp32 grads, fp32 params and grads."""
    table = {"megatron_fp16": (20, "4 + 16/d"), "megatron_bf16": (18, "6 + 12/d"),
             "fp32": (16, "8 + 8/d")}
    assert cm.MEGATRON_DISTRIBUTED_OPTIMIZER == table
    for precision, (whole, sharded) in table.items():
        assert cm.zero_total_bytes(1000, 8, 0, precision) == whole * 1000
        assert cm.zero_formula(1, precision).replace("Ψ", "").replace("N", "d") == sharded
    # the ZeRO paper's 16 keeps fp16 gradients; Megatron's bf16 keeps them in fp32: 18
    assert cm.zero_total_bytes(1, 1, 0, "mixed") == 16
    # bf16 with fp32 gradients: the reduce-scatter moves 4-byte gradients, the all-gather
    # 2-byte weights; Ψ = 1000, N = 4: 3/4 x 4000 + 3/4 x 2000 = 4500
    assert cm.zero_comm_bytes(1000, 4, 1, "megatron_bf16") == 4500
    assert cm.zero_comm_bytes(1000, 4, 0, "megatron_bf16") == 6000  # all-reduce in fp32


def test_zero_offload_partitions_by_hand():
    """A100 bf16 at 50%: 156e12 FLOP/s; PCIe 4.0 x16 31.5e9 B/s. With n = 8 GPUs each sends
    its partition, 2 bytes x Ψ / 8, and each process's Adam streams 28 bytes x Ψ / 8."""
    link = cm.offload_break_even_tokens("NVIDIA A100", "PCIe 4.0 x16", "bf16", n=8)
    assert link == pytest.approx(2 * 156e12 / (6 * 8 * 31.5e9))  # 206 tokens
    adam = cm.host_adam_break_even_tokens("NVIDIA A100", 51.2e9, n=8)
    assert adam == pytest.approx(28 * 156e12 / (6 * 8 * 51.2e9))  # 1777 tokens
    # charging one process with all Ψ at its 51.2 GB/s share gives 8 times that: 14219
    assert cm.host_adam_break_even_tokens("NVIDIA A100", 51.2e9) == pytest.approx(8 * adam)
    e = cm.zero_offload_step(10**9, 1024, "NVIDIA A100", "PCIe 4.0 x16", 51.2e9, n=8)
    assert e["compute_s"] == pytest.approx(6e9 * 1024 / 156e12)
    assert e["transfer_s"] == pytest.approx(2e9 / 8 / 31.5e9)
    assert e["adam_s"] == pytest.approx(28e9 / 8 / 51.2e9)
    assert e["dpu_s"] == e["adam_s"] and e["bottleneck"] == "host adam"
    assert e["serial_s"] == pytest.approx(e["compute_s"] + e["adam_s"])
    two_nodes = cm.zero_offload_step(10**9, 1024, "NVIDIA A100", "PCIe 4.0 x16", 51.2e9, n=16)
    assert two_nodes["bottleneck"] == "compute"
    with pytest.raises(ValueError, match="host_bandwidth must be a number > 0"):
        cm.zero_offload_step(10, 10, "NVIDIA A100", "PCIe 4.0 x16", 0.0)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        cm.offload_step(10, 10, "NVIDIA A100", "PCIe 4.0 x16", n=0)


def test_shared_host_link_and_link_in_bytes_per_second():
    # by hand: 2 bytes x 1e9 params / 8 GPUs = 250 MB each way; two GPUs per 31.5 GB/s uplink
    one = cm.offload_step(10**9, 1024, "NVIDIA A100", "PCIe 4.0 x16", "bf16", n=8)
    two = cm.offload_step(10**9, 1024, "NVIDIA A100", "PCIe 4.0 x16", "bf16", n=8, link_share=2)
    assert one["transfer_s"] == pytest.approx(2e9 / 8 / 31.5e9)
    assert two["transfer_s"] == pytest.approx(2 * one["transfer_s"])
    assert two["compute_s"] == one["compute_s"]
    # break-even: 2 B x 156e12 FLOP/s x 2 / (6 x 8 x 31.5e9 B/s)
    want = 2 * 156e12 * 2 / (48 * 31.5e9)
    assert cm.offload_break_even_tokens("NVIDIA A100", "PCIe 4.0 x16", "bf16", n=8,
                                        link_share=2) == pytest.approx(want)
    # a link given in bytes/s equals the same link by name
    assert cm.offload_step(10**9, 1024, "NVIDIA A100", 31.5e9, "bf16", n=8) == one
    e = cm.zero_offload_step(10**9, 1024, "NVIDIA A100", "PCIe 4.0 x16", 51.2e9, 8, link_share=2)
    assert e["transfer_s"] == pytest.approx(two["transfer_s"])
    with pytest.raises(ValueError, match="link_share"):
        cm.offload_step(10**9, 1024, "NVIDIA A100", "PCIe 4.0 x16", link_share=0)
    with pytest.raises(ValueError, match="link"):
        cm.offload_step(10**9, 1024, "NVIDIA A100", -1.0)


def test_zero3_gather_hidden_by_hand():
    # H100 bf16 989.4 TFLOP/s at half: a layer of L params computes 2 L t FLOPs in
    # 2 L t / 494.7e12 s; its all-gather gets 7/8 x 2 L bytes at 450 GB/s. Equal at t:
    t = 7 / 8 * 2 * 494.7e12 / (2 * 450e9)
    assert cm.zero3_gather_hidden_tokens("NVIDIA H100 SXM", "NVLink 4 (H100, per GPU)", 8) == \
        pytest.approx(t)
    layer = 10**8  # any layer size: check the two times are equal at t
    compute = 2 * layer * t / 494.7e12
    gather = 7 / 8 * 2 * layer / 450e9
    assert compute == pytest.approx(gather)
    assert cm.zero3_gather_hidden_tokens("NVIDIA H100 SXM", 450e9, 8) == pytest.approx(t)
    with pytest.raises(ValueError, match="at least 2"):
        cm.zero3_gather_hidden_tokens("NVIDIA H100 SXM", 450e9, 1)
