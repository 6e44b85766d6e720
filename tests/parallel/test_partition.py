"""accel.parallel.partition: balances against written-out tables and a brute-force search."""

import itertools

import pytest

from accel.parallel import partition


@pytest.mark.parametrize("layers, parts, expected", [
    (10, 4, [3, 3, 2, 2]), (4, 4, [1, 1, 1, 1]), (7, 1, [7]), (5, 2, [3, 2]), (6, 3, [2, 2, 2]),
])
def test_balance_by_count_table(layers, parts, expected):
    assert partition.balance_by_count(layers, parts) == expected


@pytest.mark.parametrize("costs, parts, expected", [
    ([1, 1, 1, 1], 2, [2, 2]),
    ([4, 1, 1, 1, 1], 2, [1, 4]),        # the heavy first layer alone
    ([1, 2, 3, 4, 5], 2, [3, 2]),        # 6 | 9 beats 10 | 5
    ([1] * 10, 4, [3, 3, 2, 2]),
    ([5, 1, 1, 1], 3, [1, 2, 1]),        # ties: earlier parts larger
    ([0, 0, 0], 3, [1, 1, 1]),
    ([2, 2, 8, 2, 2], 3, [2, 1, 2]),
])
def test_balance_by_cost_table(costs, parts, expected):
    assert partition.balance_by_cost(costs, parts) == expected


def test_balance_by_cost_is_optimal_against_brute_force():
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    for parts in range(1, 6):
        got = max(partition.part_costs(costs, partition.balance_by_cost(costs, parts)))
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, len(costs)),
                                                       strict=True))
                   for cut in itertools.combinations(range(1, len(costs)), parts - 1))
        assert got == best


def test_ranges_and_costs():
    assert partition.part_ranges([3, 2]) == [range(0, 3), range(3, 5)]
    assert partition.part_costs([1, 2, 3, 4, 5], [3, 2]) == [6, 9]


@pytest.mark.parametrize("call, message", [
    (lambda: partition.balance_by_count(3, 4), "cannot split 3 layers into 4 parts"),
    (lambda: partition.balance_by_count(3, 0), "num_parts must be an int >= 1, got 0"),
    (lambda: partition.balance_by_cost([], 1), "costs is empty"),
    (lambda: partition.balance_by_cost([1, -2], 1), r"costs\[1\] must be a number >= 0, got -2"),
    (lambda: partition.check_balance([2, 2], 5), r"balance \[2, 2\] adds up to 4 layers, but the "
                                                 "model has 5"),
    (lambda: partition.check_balance([3, 0], 3), r"every part needs an int >= 1 layers, got 0"),
    (lambda: partition.check_balance([], 3), "balance is empty"),
])
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
