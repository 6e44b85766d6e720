"""accel.course.overlap (chapter 07's section 8): what each bucket's sum waits for, against a
table written by hand, and a trace read back into a timeline."""

import pytest

from accel.course import overlap


def test_what_each_bucket_waits_for_by_hand(four_devices):
    """A bucket per layer (3 hidden layers of 16): bucket k holds the kernel of one layer and
    the bias of the layer below, and its sum waits for that one layer's weight gradient; one
    bucket waits for every layer's."""
    two = four_devices[:2]
    model = overlap.deep_mlp(two, depth=3, width=16)
    x, y = overlap.deep_batch(model, batch=8)
    layer = overlap.layer_bytes(model, "d0")
    assert layer == (16 * 16 + 16) * 4
    runs = overlap.tower_steps(model, two, {"layer": layer, "one": 10**9})
    assert set(runs) == {"layer", "one", "one device"}
    assert overlap.waits_for(runs["layer"][0], runs["layer"][1], x, y) == [
        (["out/bias", "out/kernel", "d2/bias"], ["out"]),
        (["d2/kernel", "d1/bias"], ["d2"]),
        (["d1/kernel", "d0/bias"], ["d1"]),
        (["d0/kernel"], ["d0"])]
    ((held, waits),) = overlap.waits_for(runs["one"][0], runs["one"][1], x, y)
    assert len(held) == 8 and waits == ["d0", "d1", "d2", "out"]


def test_traced_buckets_reads_the_sums_and_the_backward(four_devices, tmp_path):
    two = four_devices[:2]
    model = overlap.deep_mlp(two, depth=2, width=16)
    x, y = overlap.deep_batch(model, batch=8)
    runs = overlap.tower_steps(model, two, {"layer": overlap.layer_bytes(model, "d0")})
    step = runs["layer"][1]
    step(x, y)
    seen = overlap.traced_buckets(step, x, y, str(tmp_path / "a"))
    assert len(seen["sums"]) == len(step.buckets) == 3
    lanes = {lane for lane, *_ in seen["intervals"]}
    assert lanes == {"tower 0 backward", "tower 1 backward", "bucket sums"}
    assert {label for lane, *_, label in seen["intervals"] if lane == "bucket sums"} == {
        "b0", "b1", "b2"}
    assert all(end >= start for _, start, end, _ in seen["intervals"])
    with pytest.raises(ValueError, match="bucket_bytes"):
        overlap.traced_buckets(runs["one device"][1], x, y, str(tmp_path / "b"))
