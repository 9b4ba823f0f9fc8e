"""The wire format: safetensors-compatible, fp32/bf16/int8, and strict about what it accepts."""

from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from composer_serverless.rendezvous.codec import (
    CODECS,
    INT8_BLOCK,
    PayloadError,
    accumulate,
    decode,
    dequantize_int8,
    encode,
    encode_parts,
    quantize_int8,
)

IDENTITY = {"run_id": "r1", "round": "3", "fragment": "0", "rank": "1", "shard": "2"}


def values(n: int = 3000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.01, 3, n)


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_and_safetensors_compatibility(codec: str, tmp_path: Path) -> None:
    x = values()
    payload = encode(x, IDENTITY, codec)
    decoded = decode(bytes(payload), IDENTITY, codec, x.numel())
    assert decoded.dtype == torch.float32 and decoded.shape == x.shape
    tensors = safetensors.torch.load(bytes(payload))
    expected_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[codec]
    assert tensors["values"].dtype == expected_dtype
    if codec == "fp32":
        assert torch.equal(decoded, x)
    if codec == "bf16":
        assert torch.equal(decoded, x.to(torch.bfloat16).float())
    if codec == "int8":
        assert torch.equal(decoded, dequantize_int8(tensors["values"], tensors["scales"]))
        # Round-to-nearest on a grid of absmax/127 per block: at most half a step off.
        steps = torch.stack(
            [x[i : i + INT8_BLOCK].abs().max() / 127 for i in range(0, x.numel(), INT8_BLOCK)]
        )
        assert torch.all(
            (decoded - x).abs() <= steps.repeat_interleave(INT8_BLOCK)[: x.numel()] / 2 * (1 + 1e-6)
        )
    (tmp_path / "p.safetensors").write_bytes(payload)
    with safetensors.safe_open(str(tmp_path / "p.safetensors"), "pt") as f:
        assert set(f.metadata().items()) >= set(IDENTITY.items())


@pytest.mark.parametrize("codec", CODECS)
def test_accumulate_adds_what_decode_returns_bit_for_bit(codec: str) -> None:
    total = values(seed=1)
    expected = total + decode(encode(values(), IDENTITY, codec), IDENTITY, codec, 3000)
    accumulate(total, encode(values(), IDENTITY, codec), IDENTITY, codec)
    assert torch.equal(total, expected)
    assert not torch.equal(total, values(seed=1))


@pytest.mark.parametrize("codec", CODECS)
def test_parts_are_the_payload_and_fp32_parts_alias_the_values(codec: str) -> None:
    x = values()
    parts = encode_parts(x, IDENTITY, codec)
    assert b"".join(parts) == bytes(encode(x, IDENTITY, codec))
    if codec == "fp32":
        x[0] += 1  # the writer must not change its values before the parts are written: they are its memory
        assert bytes(parts[1][:4]) == struct.pack("<f", float(x[0]))


@pytest.mark.parametrize("codec", CODECS)
def test_parts_decode_and_accumulate_as_the_joined_payload(codec: str) -> None:
    """A reducer adds its own input from the parts it wrote, without joining them: same values, same sum."""
    x = values()
    parts = encode_parts(x, IDENTITY, codec)
    joined = bytes(encode(x, IDENTITY, codec))
    assert torch.equal(decode(parts, IDENTITY, codec, 3000), decode(joined, IDENTITY, codec, 3000))
    total, expected = values(seed=1), values(seed=1)
    accumulate(total, parts, IDENTITY, codec, verify=False)
    accumulate(expected, joined, IDENTITY, codec)
    assert torch.equal(total, expected)
    # Parts are checked as a payload is: a wrong identity, or a changed value under a checksum.
    with pytest.raises(PayloadError, match="mismatch"):
        decode(parts, {**IDENTITY, "shard": "0"}, codec, 3000)
    body = bytearray(b"".join(parts[1:]))
    body[0] ^= 0xFF
    with pytest.raises(PayloadError, match="checksum"):
        decode([parts[0], memoryview(body)], IDENTITY, codec, 3000)


def test_accumulate_leaves_the_total_alone_when_it_rejects() -> None:
    total = values(seed=1)
    payload = encode(values(), IDENTITY, "fp32")
    payload[-1] ^= 0xFF
    with pytest.raises(PayloadError, match="checksum"):
        accumulate(total, payload, IDENTITY, "fp32")
    with pytest.raises(PayloadError, match="mismatch"):
        accumulate(total, encode(values(), IDENTITY, "fp32"), {**IDENTITY, "rank": "0"}, "fp32")
    assert torch.equal(total, values(seed=1))


@pytest.mark.parametrize("n", [0, 1, INT8_BLOCK - 1, INT8_BLOCK, INT8_BLOCK + 1])
@pytest.mark.parametrize("codec", CODECS)
def test_edge_sizes(codec: str, n: int) -> None:
    x = values(n) if n else torch.empty(0)
    assert decode(encode(x, IDENTITY, codec), IDENTITY, codec, n).shape == (n,)


def test_int8_is_deterministic_and_handles_zero_blocks() -> None:
    x = torch.cat([torch.zeros(INT8_BLOCK), values(100)])
    q1, s1 = quantize_int8(x)
    q2, s2 = quantize_int8(x.clone())
    assert torch.equal(q1, q2) and torch.equal(s1, s2)
    assert torch.equal(dequantize_int8(q1, s1)[:INT8_BLOCK], torch.zeros(INT8_BLOCK))


def test_int8_moves_at_least_3_9x_fewer_bytes_than_fp32() -> None:
    x = values(1 << 20)
    fp32, int8 = len(encode(x, IDENTITY, "fp32")), len(encode(x, IDENTITY, "int8"))
    bf16 = len(encode(x, IDENTITY, "bf16"))
    assert fp32 / int8 >= 3.9
    assert fp32 / bf16 >= 1.99


@pytest.mark.parametrize("codec", CODECS)
def test_corrupted_payload_is_rejected(codec: str) -> None:
    payload = encode(values(), IDENTITY, codec)
    payload[-5] ^= 0x01
    with pytest.raises(PayloadError, match="checksum"):
        decode(payload, IDENTITY, codec, 3000)


@pytest.mark.parametrize("cut", [3, 100, -1, -1000])
def test_truncated_payload_is_rejected(cut: int) -> None:
    payload = bytes(encode(values(), IDENTITY, "fp32"))
    with pytest.raises(PayloadError):
        decode(payload[:cut], IDENTITY, "fp32", 3000)


@pytest.mark.parametrize(
    ("field", "value"),
    [("run_id", "another-run"), ("round", "2"), ("fragment", "1"), ("rank", "0"), ("shard", "0")],
)
def test_foreign_payload_is_rejected(field: str, value: str) -> None:
    payload = encode(values(), {**IDENTITY, field: value}, "fp32")
    with pytest.raises(PayloadError, match="mismatch"):
        decode(payload, IDENTITY, "fp32", 3000)


def test_wrong_codec_or_size_is_rejected() -> None:
    payload = encode(values(), IDENTITY, "bf16")
    with pytest.raises(PayloadError, match="codec"):
        decode(payload, IDENTITY, "fp32", 3000)
    with pytest.raises(PayloadError, match="numel"):
        decode(payload, IDENTITY, "bf16", 2999)


def test_a_tampered_layout_is_rejected_even_with_a_matching_checksum() -> None:
    """Relabelling the dtype (and fixing the checksum) must not make bytes decode as another type."""
    payload = encode(values(), IDENTITY, "fp32")
    (length,) = struct.unpack("<Q", payload[:8])
    header = json.loads(bytes(payload[8 : 8 + length]))
    header["values"]["dtype"] = "I32"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    forged = struct.pack("<Q", len(raw)) + raw + bytes(payload[8 + length :])
    with pytest.raises(PayloadError, match="layout"):
        decode(forged, IDENTITY, "fp32", 3000)


class _CreatesAFile:
    """Unpickling this creates the file at ``path``: proof that a payload was executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_pickle_and_torch_save_payloads_are_rejected_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    evil = pickle.dumps(_CreatesAFile(marker))
    pickle.loads(pickle.dumps(_CreatesAFile(tmp_path / "sanity")))
    assert (tmp_path / "sanity").exists()  # the gadget really does run when unpickled
    buffer = io.BytesIO()
    torch.save({"values": torch.ones(3), "gadget": _CreatesAFile(marker)}, buffer)
    for payload in (evil, buffer.getvalue()):
        with pytest.raises(PayloadError):
            decode(payload, IDENTITY, "fp32", 3)
    assert not marker.exists()


def test_skipping_verification_still_checks_identity_and_layout() -> None:
    """verify=False is for payloads a replica encoded itself: it skips only the checksum."""
    payload = encode(values(), IDENTITY, "fp32")
    payload[-5] ^= 0x01
    decode(payload, IDENTITY, "fp32", 3000, verify=False)
    with pytest.raises(PayloadError, match="mismatch"):
        decode(payload, {**IDENTITY, "round": "4"}, "fp32", 3000, verify=False)
    with pytest.raises(PayloadError):
        decode(payload[:-1], IDENTITY, "fp32", 3000, verify=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_values_are_rejected_whatever_their_checksum(codec: str, bad: float) -> None:
    """A payload's own checksum is valid for whatever it holds; a NaN or Inf is still not averaged."""
    forged = values()
    forged[7] = bad
    payload = encode(forged, IDENTITY, codec)
    total = values(seed=1)
    for verify in (True, False):
        with pytest.raises(PayloadError, match="non-finite"):
            decode(payload, IDENTITY, codec, 3000, verify=verify)
        with pytest.raises(PayloadError, match="non-finite"):
            accumulate(total, payload, IDENTITY, codec, verify=verify)
    assert torch.equal(total, values(seed=1))


def test_finite_values_whose_sum_overflows_are_accepted() -> None:
    """The fast check sums the values; a sum that overflows from finite values falls back to checking each."""
    huge = torch.full((4,), 3e38)
    assert torch.isinf(huge.sum())
    assert torch.equal(decode(encode(huge, IDENTITY, "fp32"), IDENTITY, "fp32", 4), huge)
