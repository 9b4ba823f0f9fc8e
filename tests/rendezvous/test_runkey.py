"""The run key and its MAC: payloads and snapshots written without the key, or with another, are refused by
a reader that holds it; the key never shows in a repr, a pickle or an error; where the launcher keeps it."""

from __future__ import annotations

import json
import pickle
import stat
import struct
from pathlib import Path

import pytest
import torch

from composer_serverless.config import ConfigError
from composer_serverless.rendezvous.checkpoint import CheckpointError, read_snapshot, write_snapshot
from composer_serverless.rendezvous.codec import PayloadError, accumulate, decode, encode, read_header
from composer_serverless.rendezvous.run_keys import key_path, new_run_key, saved_run_key
from composer_serverless.rendezvous.runkey import (
    ENV,
    MAC_FIELD,
    RunKey,
    RunKeyError,
    WrongRunKey,
    check_fingerprint,
    record_fingerprint,
)
from composer_serverless.rendezvous.store import ObjectStore

IDENTITY = {"run_id": "r1", "round": "3", "fragment": "0", "rank": "1", "shard": "2"}
KEY = RunKey(bytes(range(32)))


def test_keyed_blake3_is_the_reference_keyed_hash() -> None:
    """The MAC is BLAKE3 in keyed mode: the official test vector (input of 0 bytes, key
    'whats the Elvish word for friend')."""
    key = RunKey(b"whats the Elvish word for friend")
    assert key.mac([b""]) == "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26"


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_a_keyed_payload_round_trips_and_carries_a_mac_instead_of_the_checksum(codec: str) -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    payload = encode(x, IDENTITY, codec, KEY)
    metadata = read_header(payload)[0]["__metadata__"]
    assert MAC_FIELD in metadata and "xxh3_128" not in metadata
    assert torch.equal(
        decode(payload, IDENTITY, codec, x.numel(), key=KEY),
        decode(encode(x, IDENTITY, codec), IDENTITY, codec, x.numel()),
    )


def test_a_reader_with_the_key_refuses_no_mac_a_wrong_mac_and_altered_bytes() -> None:
    x = torch.randn(1000)
    unkeyed = encode(x, IDENTITY, "fp32")  # a valid checksum, no MAC
    with pytest.raises(PayloadError, match="carries no MAC"):
        decode(unkeyed, IDENTITY, "fp32", x.numel(), key=KEY)
    other = encode(x, IDENTITY, "fp32", RunKey.generate())
    with pytest.raises(PayloadError, match="MAC mismatch"):
        decode(other, IDENTITY, "fp32", x.numel(), key=KEY)
    flipped = encode(x, IDENTITY, "fp32", KEY)
    flipped[-1] ^= 1
    total = torch.zeros(x.numel())
    with pytest.raises(PayloadError, match="MAC mismatch"):
        accumulate(total, flipped, IDENTITY, "fp32", key=KEY)
    assert not total.any()  # nothing was added


def test_a_forged_mac_of_any_text_is_refused_not_a_crash(tmp_path: Path) -> None:
    """A forger picks the MAC's text: non-ASCII (which ``compare_digest`` refuses to compare) or not a string
    is a wrong MAC like any other, in a payload and in the run's fingerprint record."""
    x = torch.randn(100)
    payload = bytes(encode(x, IDENTITY, "fp32", KEY))
    header, start = read_header(payload)
    for forged in ("é" * 64, "\ud800" * 64):
        header["__metadata__"][MAC_FIELD] = forged
        raw = json.dumps(header).encode()  # escaped to ASCII, as a forger may write it
        edited = struct.pack("<Q", len(raw)) + raw + payload[start:]
        with pytest.raises(PayloadError, match="MAC mismatch"):
            decode(edited, IDENTITY, "fp32", x.numel(), key=KEY)
    assert not KEY.verify(["not", "a", "string"], [b""])
    store = ObjectStore(f"file://{tmp_path}/run")
    store.put("key.json", json.dumps({"fingerprint": "é" * 64}).encode())
    with pytest.raises(WrongRunKey):
        check_fingerprint(store, KEY)


def test_a_runs_key_is_bound_to_its_run_id(tmp_path: Path) -> None:
    """One key exported for two runs: each run's replicas MAC with the key bound to its id, so a genuine state
    of run a copied into run b is refused there."""
    a, b = KEY.for_run("run-a"), KEY.for_run("run-b")
    assert a == KEY.for_run("run-a") and a != b and a != KEY
    store = ObjectStore(f"file://{tmp_path}/s")
    write_snapshot(store, "state/4/0", {"w": torch.arange(3.0)}, a)
    assert torch.equal(read_snapshot(store, "state/4/0", a)["w"], torch.arange(3.0))
    with pytest.raises(CheckpointError, match="MAC"):
        read_snapshot(store, "state/4/0", b)


def test_the_mac_covers_the_header_so_a_payload_cannot_be_relabelled() -> None:
    """A reduced shard whose 'summed' list was edited (to claim inputs it did not average) no longer
    verifies, though its data is untouched."""
    x = torch.randn(1000)
    identity = {**IDENTITY, "rank": "reduced"}
    payload = bytes(encode(x, {**identity, "summed": "0,1"}, "fp32", KEY))
    edited = payload.replace(b'"summed":"0,1"', b'"summed":"0,2"')
    assert edited != payload
    decode(payload, identity, "fp32", x.numel(), key=KEY)
    with pytest.raises(PayloadError, match="MAC mismatch"):
        decode(edited, identity, "fp32", x.numel(), key=KEY)


def test_a_snapshot_needs_a_valid_mac_for_its_prefix(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/s")
    tree = {"step": 4, "w": torch.arange(6.0)}
    write_snapshot(store, "state/4/0", tree, KEY)
    assert torch.equal(read_snapshot(store, "state/4/0", KEY)["w"], tree["w"])
    write_snapshot(store, "state/5/0", tree)  # written without the key (sha256 only)
    with pytest.raises(CheckpointError, match="malformed|MAC"):
        read_snapshot(store, "state/5/0", KEY)
    write_snapshot(store, "state/6/0", tree, RunKey.generate())
    with pytest.raises(CheckpointError, match="MAC"):
        read_snapshot(store, "state/6/0", KEY)
    for name in store.list("state/4/0"):  # a genuine state of round 4 replayed as round 7
        store.put(f"state/7/0/{name}", store.get(f"state/4/0/{name}"))
    with pytest.raises(CheckpointError, match="MAC"):
        read_snapshot(store, "state/7/0", KEY)


def test_the_key_never_shows_and_is_never_pickled() -> None:
    key = RunKey.generate()
    assert key.hex() not in repr(key) and key.hex() not in str(key)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(key)
    with pytest.raises(RunKeyError, match="64 hexadecimal digits") as error:
        RunKey.from_hex("zz" + key.hex()[2:])
    assert key.hex()[2:] not in str(error.value)
    assert RunKey.from_hex(key.hex()) == key


def test_the_launcher_keeps_a_new_key_for_the_user_alone(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    url = "s3://bucket/runs/r1"
    key = new_run_key(url, env)
    path = key_path(url, env)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert saved_run_key(url, env) == key
    assert new_run_key(url, env) == key  # a key file is never overwritten
    mine = RunKey.generate()
    assert saved_run_key(url, {**env, ENV: mine.hex()}) == mine  # the environment wins
    assert new_run_key("s3://bucket/runs/r2", {**env, ENV: mine.hex()}) == mine
    assert not key_path("s3://bucket/runs/r2", env).exists()  # the user keeps their own key


def test_a_resume_without_the_key_says_how_to_fix_it(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    with pytest.raises(ConfigError, match=f"fix: export {ENV}"):
        saved_run_key("s3://bucket/runs/lost", env)
    with pytest.raises(ConfigError, match="not a run key"):
        saved_run_key("s3://bucket/runs/lost", {**env, ENV: "not-hex"})


def test_a_key_that_is_not_the_runs_is_told_apart_by_its_fingerprint(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/run")
    check_fingerprint(store, KEY)  # nothing recorded: nothing to compare with
    record_fingerprint(store, KEY)
    record_fingerprint(store, RunKey.generate())  # created once: a second launcher keeps the first
    check_fingerprint(store, KEY)
    with pytest.raises(WrongRunKey, match="not this run's"):
        check_fingerprint(store, RunKey.generate())
    assert KEY.hex() not in store.get("key.json").decode()
