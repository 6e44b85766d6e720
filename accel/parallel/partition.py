"""Cutting a sequence of layers into consecutive parts, one part per device: the decision behind
model parallelism (chapter 09) and pipeline stages (chapter 10).

A *balance* is the list of part sizes in layers, e.g. ``[3, 3, 2, 2]`` for ten layers on four
devices (the word kakaobrain/torchgpipe uses). Everything here is a pure function of plain
numbers, so a balance can be computed from layer counts, parameter bytes or measured times, and
checked against written-out tables:

* ``balance_by_count(num_layers, num_parts)``: sizes as equal as possible;
* ``balance_by_cost(costs, num_parts)``: the contiguous split whose most expensive part is as
  cheap as possible (exact), for costs in bytes or seconds;
* ``part_ranges`` / ``part_costs``: the layer ranges and total cost of each part of a balance;
* ``check_balance``: a balance that cannot describe ``num_layers`` layers is a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence

from accel import checks

__all__ = ["check_balance", "balance_by_count", "balance_by_cost", "part_ranges", "part_costs"]


def check_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """``balance`` as a list, if its parts are ints >= 1 that add up to ``num_layers``."""
    checks.positive_int("num_layers", num_layers)
    sizes = list(balance)
    if not sizes:
        raise ValueError("balance is empty: give one size (in layers) per part")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"balance {sizes}: every part needs an int >= 1 layers, got {size!r}")
    if sum(sizes) != num_layers:
        raise ValueError(f"balance {sizes} adds up to {sum(sizes)} layers, but the model has "
                         f"{num_layers}")
    return sizes


def _check_parts(num_layers: int, num_parts: int) -> None:
    checks.positive_int("num_parts", num_parts)
    if num_parts > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_parts} parts: every part "
                         "needs at least one layer")


def balance_by_count(num_layers: int, num_parts: int) -> list[int]:
    """Part sizes as equal as possible, the larger parts first: 10 layers, 4 parts ->
    ``[3, 3, 2, 2]``."""
    checks.positive_int("num_layers", num_layers)
    _check_parts(num_layers, num_parts)
    base, extra = divmod(num_layers, num_parts)
    return [base + (i < extra) for i in range(num_parts)]


def balance_by_cost(costs: Sequence[float], num_parts: int) -> list[int]:
    """The contiguous split of layers with ``costs`` (bytes, seconds, FLOPs: any non-negative
    numbers) into ``num_parts`` parts that minimises the cost of the most expensive part.

    Exact (dynamic programming over split points, O(parts x layers^2)). Among equally good
    splits it takes the one whose earlier parts are largest, so the result is deterministic.
    """
    costs = [checks.non_negative_number(f"costs[{i}]", c) for i, c in enumerate(costs)]
    if not costs:
        raise ValueError("costs is empty: give one cost per layer")
    n = len(costs)
    _check_parts(n, num_parts)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum part cost of layers i.. split into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][n] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(n - k, -1, -1):
            for j in range(n - k + 1, i, -1):  # first part = layers i..j-1, largest first
                value = max(prefix[j] - prefix[i], best[k - 1][j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], 0
    for k in range(num_parts, 0, -1):
        sizes.append(cut[k][i] - i)
        i = cut[k][i]
    return sizes


def part_ranges(balance: Sequence[int]) -> list[range]:
    """The layer indices of each part: ``[3, 2]`` -> ``[range(0, 3), range(3, 5)]``."""
    sizes = check_balance(balance, sum(balance) if balance else 1)
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def part_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The total cost of each part of ``balance`` for per-layer ``costs``."""
    check_balance(balance, len(costs))
    return [sum(costs[i] for i in r) for r in part_ranges(balance)]
