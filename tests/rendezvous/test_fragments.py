"""How a sharded syncer cuts the global into fragments (syncer/shards.py): hand-computed partitions."""

from __future__ import annotations

import itertools

import pytest

from composer_serverless.rendezvous.fragments import fragment_groups


def named(*numels: int) -> list[tuple[str, int]]:
    return [(f"t{i}", n) for i, n in enumerate(numels)]


def test_one_fragment_is_the_whole_global() -> None:
    assert fragment_groups(named(3, 1, 4), 1) == [["t0", "t1", "t2"]]


def test_equal_tensors_split_evenly() -> None:
    assert fragment_groups(named(4, 4, 4, 4), 2) == [["t0", "t1"], ["t2", "t3"]]
    assert fragment_groups(named(4, 4, 4, 4), 4) == [["t0"], ["t1"], ["t2"], ["t3"]]


def test_a_big_tensor_takes_a_fragment_of_its_own() -> None:
    # The embedding (8) cannot be cut: the best largest fragment is 8, and the rest (4) go together.
    assert fragment_groups(named(8, 1, 1, 1, 1), 2) == [["t0"], ["t1", "t2", "t3", "t4"]]
    # Three fragments at capacity 8: the small ones fill the first, then one each is forced so none is empty.
    assert fragment_groups(named(1, 1, 1, 1, 8), 3) == [["t0", "t1", "t2"], ["t3"], ["t4"]]


def test_the_cut_balances_by_elements() -> None:
    # 10 | 6 + 3 (9) is the best two-way cut of [10, 6, 3] (the other, 16 | 3, is worse); [5, 5, 2, 8] cuts
    # as 5 + 5 | 2 + 8 (10, 10).
    assert fragment_groups(named(10, 6, 3), 2) == [["t0"], ["t1", "t2"]]
    assert fragment_groups(named(5, 5, 2, 8), 2) == [["t0", "t1"], ["t2", "t3"]]


@pytest.mark.parametrize("numels", [(7, 3, 9, 2, 2, 6, 1, 5), (1, 100, 1, 1, 50, 50), (0, 0, 5, 0, 3)])
def test_no_contiguous_cut_has_a_smaller_largest_fragment(numels: tuple[int, ...]) -> None:
    for fragments in range(1, len(numels) + 1):
        groups = fragment_groups(named(*numels), fragments)
        assert [name for group in groups for name in group] == [f"t{i}" for i in range(len(numels))]
        assert len(groups) == fragments and all(groups)
        sizes = {f"t{i}": n for i, n in enumerate(numels)}
        largest = max(sum(sizes[name] for name in group) for group in groups)
        best = min(
            max(sum(numels[a:b]) for a, b in itertools.pairwise((0, *cuts, len(numels))))
            for cuts in itertools.combinations(range(1, len(numels)), fragments - 1)
        )
        assert largest == best


def test_refusals_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="at most 3 shards"):
        fragment_groups(named(1, 2, 3), 4)
    with pytest.raises(ValueError, match="must be >= 1"):
        fragment_groups(named(1, 2, 3), 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        fragment_groups(named(1, -2, 3), 2)
