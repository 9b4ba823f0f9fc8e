"""Which contributions a robust average leaves out: those whose norm lies far outside the others'.

A checksum (or a MAC) proves that a payload arrived as its writer wrote it, and the finiteness check that it
holds numbers; neither says the numbers are sane. A replica whose own inner loop blew up writes a valid,
finite pseudo-gradient of norm 1e30, and averaged in it ends the run for everyone. Pseudo-gradients of one
round are of one size (the same model, the same steps, the same learning rate, data from one distribution),
so one many times the median of the round's is not a different view of the data: it is a fault, and leaving
it out costs the round one replica's share, as a dead replica does.

Every shard's owner judges a replica on the same number: the norm of its whole pseudo-gradient that it
published once for the sync (``norms.py``; a retry states the one its first attempt published), never on a
shard's own norm nor on what the inputs it could read state. All owners take the reference from the published
norms of the quorum's participants, the same set whatever inputs each could read, so they leave out the same
replicas in every shard, and a replica's residual of error feedback stays whole in every shard
(``feedback.py``). An input whose header states another norm than its replica published is refused like a
bad checksum (``allreduce.py``); an input that cannot be read is left out of its own shard only, which is no
judgement of its replica.

The rule needs company: with a quorum of fewer than ``MIN_CONTRIBUTIONS`` there is no majority to say which one
is wrong, and every contribution is kept; the count is the quorum's, the same for every shard's owner, not the
number of inputs a shard's owner could read. The reference is the lower median of the non-zero norms: a replica that sent nothing (no progress,
a frozen fragment) says nothing about the round's scale and would otherwise pull the median to 0 and reject
every replica that moved; the lower of the middle two, so that with an even count the reference is a norm some
replica sent and a blown-up one is never the reference while the others agree.
"""

from __future__ import annotations

import statistics

MIN_CONTRIBUTIONS = 3


def outliers(norms: dict[int, float], factor: float | None, quorum: int) -> dict[int, str]:
    """The ranks among ``norms`` (rank -> the norm it published for its whole pseudo-gradient) to leave out,
    each with why: a norm above ``factor`` times the lower median of the non-zero norms. None for ``factor``, a
    ``quorum`` (the sync's participants) below ``MIN_CONTRIBUTIONS``, or no non-zero norm: none."""
    moving = [norm for norm in norms.values() if norm > 0]
    if factor is None or quorum < MIN_CONTRIBUTIONS or not moving:
        return {}
    reference = statistics.median_low(moving)
    return {
        rank: (
            f"its pseudo-gradient norm {norm:.4g} is more than {factor:g} times the median {reference:.4g} of the "
            f"{len(moving)} non-zero contributions"
        )
        for rank, norm in sorted(norms.items())
        if norm > factor * reference
    }
