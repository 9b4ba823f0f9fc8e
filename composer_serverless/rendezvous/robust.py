"""Which contributions a robust average leaves out: those whose norm lies far outside the others'.

A checksum (or a MAC) proves that a payload arrived as its writer wrote it, and the finiteness check that it
holds numbers; neither says the numbers are sane. A replica whose own inner loop blew up writes a valid,
finite pseudo-gradient of norm 1e30, and averaged in it ends the run for everyone. Pseudo-gradients of one
round are of one size (the same model, the same steps, the same learning rate, data from one distribution),
so one many times the median of the round's is not a different view of the data: it is a fault, and leaving
it out costs the round one replica's share, as a dead replica does.

The median needs company: with fewer than ``MIN_CONTRIBUTIONS`` there is no majority to say which one is
wrong, and every contribution is kept. The decision uses the norms the payloads state for their whole
pseudo-gradient (each checked against the shard's own values, ``codec.measure``), so every shard's owner
decides the same for the same replica, and every replica applies the same average.
"""

from __future__ import annotations

import statistics

MIN_CONTRIBUTIONS = 3


def outliers(norms: dict[int, float], factor: float | None) -> dict[int, str]:
    """The ranks among ``norms`` (rank -> its pseudo-gradient's norm) to leave out, each with why: a norm above
    ``factor`` times the median of all of them. None (or fewer than ``MIN_CONTRIBUTIONS``): none."""
    if factor is None or len(norms) < MIN_CONTRIBUTIONS:
        return {}
    median = statistics.median(norms.values())
    return {
        rank: (
            f"its pseudo-gradient norm {norm:.4g} is more than {factor:g} times the median {median:.4g} of the "
            f"{len(norms)} contributions"
        )
        for rank, norm in sorted(norms.items())
        if norm > factor * median
    }
