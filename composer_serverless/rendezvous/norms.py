"""The norm a replica is judged on in one sync, published once, so that every shard's owner judges it alike.

The outlier rule (``robust.py``) compares whole pseudo-gradients, but each shard's owner reads one shard of
each. If owners judged on what they read (the norm each input's header states), they could judge one replica
differently: an input unreadable in one shard takes its norm out of that shard's reference (a different
median), and a retried sync mixes the inputs an earlier attempt stored with new ones that may state another
norm. So each replica publishes its norm once per sync and part (``norm/{rank}.json`` under its local rank's
prefix, create-if-absent before its first input): a retry finds the record and states the number it holds in
every new input, and every owner judges on the records of the quorum's participants, the same set of numbers
whatever inputs it could read. A replica of G ranks is judged on the norm of its whole pseudo-gradient, the
root of the sum of its G parts' squares (``whole``), in every local rank's exchange alike.

With a run key the record carries a MAC over its norm and the sync it belongs to (run, round, fragment, local
rank, rank), like a payload: a writer without the key cannot make an owner judge a replica on a number the
replica never stated, nor replay a record of another sync.
"""

from __future__ import annotations

import json
import math

from composer_serverless.rendezvous.runkey import MAC_FIELD, RunKey, framed

NORM_FIELD = "norm"


def record(norm: float, identity: dict[str, str], key: RunKey | None) -> bytes:
    """The record of ``norm`` for the replica and sync ``identity`` names (run, round, fragment, local, rank)."""
    doc: dict[str, object] = {NORM_FIELD: repr(norm), "identity": identity}
    if key is not None:
        doc[MAC_FIELD] = key.mac(_mac_input(repr(norm), identity))
    return json.dumps(doc, sort_keys=True).encode()


def parse(raw: bytes, identity: dict[str, str], key: RunKey | None) -> float | str:
    """The norm ``raw`` records for ``identity``, or why it is not a record of one: not JSON, another sync's
    or replica's, without a valid MAC (with ``key``), or no finite non-negative number."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return f"not JSON ({raw[:80]!r})"
    if not isinstance(doc, dict) or not isinstance(doc.get(NORM_FIELD), str):
        return f"no norm in it ({raw[:80]!r})"
    stated = doc[NORM_FIELD]
    if doc.get("identity") != identity:
        return f"it is the record of {doc.get('identity')!r}, not of {identity!r}"
    if key is not None and not key.verify(doc.get(MAC_FIELD), _mac_input(stated, identity)):
        return "its MAC is missing or wrong"
    try:
        norm = float(stated)
    except ValueError:
        return f"its norm {stated!r} is not a number"
    if not (math.isfinite(norm) and norm >= 0):
        return f"its norm {stated!r} is not a finite non-negative number"
    return norm


def whole(parts: list[float]) -> float:
    """The norm of a pseudo-gradient from the norms of its disjoint parts (a replica's local ranks'); one
    part's own norm for one part, exactly."""
    return math.hypot(*parts)


def _mac_input(norm: str, identity: dict[str, str]) -> list[bytes]:
    return [b"composer-serverless norm ", framed(json.dumps(identity, sort_keys=True)), framed(norm)]
