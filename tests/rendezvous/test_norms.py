"""The norm records the outlier rule judges on (``rendezvous/norms.py``): what a reader accepts, hand-checked."""

from __future__ import annotations

import json

from composer_serverless.rendezvous.norms import parse, record, whole
from composer_serverless.rendezvous.runkey import MAC_FIELD, RunKey

IDENTITY = {"run_id": "run", "round": "3", "fragment": "1", "local": "0", "rank": "2"}


def test_a_record_reads_back_its_norm_exactly() -> None:
    norm = 0.1 + 0.2  # not a short decimal: the record keeps every bit
    assert parse(record(norm, IDENTITY, None), IDENTITY, None) == norm
    key = RunKey.generate()
    assert parse(record(norm, IDENTITY, key), IDENTITY, key) == norm


def test_a_record_of_another_sync_or_without_a_valid_mac_is_refused_with_why() -> None:
    key = RunKey.generate()
    assert "not of" in str(parse(record(1.0, IDENTITY, key), {**IDENTITY, "round": "4"}, key))
    assert "not of" in str(parse(record(1.0, IDENTITY, key), {**IDENTITY, "rank": "1"}, key))
    assert parse(record(1.0, IDENTITY, None), IDENTITY, key) == "its MAC is missing or wrong"
    assert parse(record(1.0, IDENTITY, RunKey.generate()), IDENTITY, key) == "its MAC is missing or wrong"
    # The MAC covers the number: a genuine record whose norm was rewritten is refused.
    doc = json.loads(record(1.0, IDENTITY, key))
    doc["norm"] = repr(1e-3)
    assert parse(json.dumps(doc).encode(), IDENTITY, key) == "its MAC is missing or wrong"
    assert MAC_FIELD in doc


def test_a_malformed_record_is_refused_with_why() -> None:
    assert str(parse(b"\x00garbage", IDENTITY, None)).startswith("not JSON")
    assert str(parse(b"[1.0]", IDENTITY, None)).startswith("no norm in it")
    for bad in ("nan", "inf", "-1.0", "one"):
        raw = json.dumps({"norm": bad, "identity": IDENTITY}).encode()
        assert isinstance(parse(raw, IDENTITY, None), str), bad


def test_a_replicas_whole_norm_is_the_root_of_its_parts_squares() -> None:
    assert whole([3.0, 4.0]) == 5.0
    assert whole([0.1 + 0.2]) == 0.1 + 0.2  # one part: its own norm, exactly
    assert whole([1e200, 1e200]) == 1e200 * 2**0.5  # no overflow on the way
