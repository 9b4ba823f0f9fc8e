"""How a sharded syncer (issue 49, ``diloco.decoupled.syncer_shards``) cuts the global into fragments: pure.

One syncer downloads every learner's whole contribution per merge (N x S bytes, ``benchmarks/syncer_bytes.py``),
so its link is the bottleneck from a few learners on (RESULTS 23: N = 4 at 8B). Split across F syncer shards,
each moves about 1/F of that. A fragment is a group of **whole** parameter tensors, so the per-tensor merge
(``merge.merge_tensors``: RDA per tensor, the embeddings' plain average) is the same whichever shard runs it;
the groups are contiguous in the global's parameter order (a fragment's contribution is a slice of today's
flat contribution) and balanced by element count, the bytes each shard moves.

The learner that writes version 0 cuts the groups and its record names them (``Version.fragments``), so every
learner and every shard uses that one cut; the partition is the one with the smallest largest fragment (ties
broken by filling earlier fragments first).
"""

from __future__ import annotations

from collections.abc import Sequence


def fragment_groups(names_and_numels: Sequence[tuple[str, int]], fragments: int) -> list[list[str]]:
    """The parameter names cut into ``fragments`` contiguous, non-empty groups, in order, whose largest
    element count is as small as any contiguous cut allows.

    The smallest feasible largest fragment is found by bisection over the capacity (a greedy fill decides
    whether a capacity can hold every tensor in ``fragments`` groups); at that capacity the greedy fill
    closes a group early only when each tensor left must then take a group of its own.

    Raises:
        ValueError: ``fragments`` < 1, more fragments than tensors (each fragment needs a whole tensor:
            lower ``diloco.decoupled.syncer_shards``), or a negative element count.
    """
    if fragments < 1:
        raise ValueError(f"diloco.decoupled.syncer_shards must be >= 1, got {fragments}")
    if fragments > len(names_and_numels):
        raise ValueError(
            f"diloco.decoupled.syncer_shards = {fragments} but the model has {len(names_and_numels)} parameter "
            f"tensors: a fragment is a group of whole tensors, so use at most {len(names_and_numels)} shards"
        )
    negative = [(name, n) for name, n in names_and_numels if n < 0]
    if negative:
        raise ValueError(f"element counts must be >= 0, got {negative}")
    numels = [n for _, n in names_and_numels]
    low, high = max(numels), sum(numels)
    while low < high:  # the smallest capacity whose greedy fill needs at most `fragments` groups
        middle = (low + high) // 2
        if len(_fill(numels, middle, 1)) <= fragments:
            high = middle
        else:
            low = middle + 1
    cuts = _fill(numels, low, fragments)
    names = [name for name, _ in names_and_numels]
    return [names[start:end] for start, end in zip(cuts, [*cuts[1:], len(names)], strict=True)]


def _fill(numels: Sequence[int], capacity: int, fragments: int) -> list[int]:
    """The start index of each group of a greedy fill up to ``capacity`` elements per group; with
    ``fragments`` > 1 a group is also closed once the tensors left are as many as the groups still to
    open, so the fill makes exactly ``fragments`` groups when the capacity allows at most that many."""
    starts, load = [0], 0
    for i, n in enumerate(numels):
        left_after_this_group = fragments - len(starts)
        if i > starts[-1] and (load + n > capacity or len(numels) - i <= left_after_this_group):
            starts.append(i)
            load = 0
        load += n
    return starts
