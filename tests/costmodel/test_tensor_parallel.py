"""The tensor-parallel cost model against figures worked out by hand."""

import pytest

from accel.costmodel import tensor_parallel as cm
from accel.costmodel.collectives import ring_all_reduce_bytes


def test_bytes_by_hand():
    # ring over 4 devices sends 2 * 3/4 = 1.5x the tensor
    assert ring_all_reduce_bytes(1000, 4) == 1500
    assert ring_all_reduce_bytes(1000, 1) == 0
    # b=8, s=1024, h=4096, fp16: activation 64 MiB; 4 all-reduces x 1.5 (n=4) = 384 MiB
    assert cm.tp_bytes_per_layer(8, 1024, 4096, 4) == 4 * 1.5 * 8 * 1024 * 4096 * 2
    # data parallel: 12 h^2 fp16 gradients x 1.5
    assert cm.dp_bytes_per_layer(4096, 4) == 1.5 * 12 * 4096 ** 2 * 2
    assert cm.layer_bytes_held(1024, 4, "tensor") == 12 * 1024 ** 2 * 16 / 4
    assert cm.layer_bytes_held(1024, 4, "data") == 12 * 1024 ** 2 * 16


def test_nvlink_pays_ethernet_does_not():
    fast = cm.tp_layer_time(8, 1024, 4096, 8, "NVIDIA A100", "NVLink 3 (A100, per GPU)")
    slow = cm.tp_layer_time(8, 1024, 4096, 8, "NVIDIA A100", "100 Gb Ethernet")
    # by hand: compute 3*24*8*1024*4096^2 / (312e12*0.5) / 8; comm 4*1.75*64Mi / bandwidth
    compute = 3 * 24 * 8 * 1024 * 4096 ** 2 / 156e12 / 8
    assert fast["compute_s"] == pytest.approx(compute)
    assert fast["comm_s"] == pytest.approx(4 * 1.75 * 8 * 1024 * 4096 * 2 / 300e9)
    assert fast["efficiency"] > 0.5 > slow["efficiency"]


def test_bad_input():
    with pytest.raises(ValueError, match="parallel must be one of"):
        cm.layer_bytes_held(8, 2, "pipeline")
    with pytest.raises(ValueError, match="utilization must be in"):
        cm.tp_layer_time(1, 1, 8, 2, "NVIDIA A100", "PCIe 4.0 x16", utilization=2)
