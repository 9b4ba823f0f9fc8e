"""The sparse codec: top-k per chunk in two bits, its exact bytes, its strictness, and error feedback."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from composer_serverless.rendezvous.codec import (
    CHECKSUM,
    NORM,
    PayloadError,
    accumulate,
    checksum,
    data_bytes,
    decode,
    encode,
    encode_parts,
    measure,
    read_header,
)
from composer_serverless.rendezvous.feedback import ErrorFeedback, carried_share
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.sparse import Sparse, compress, expand

IDENTITY = {"run_id": "r1", "round": "3", "fragment": "0", "rank": "1", "shard": "2"}
SMALL = Sparse(density=0.25, chunk=8)  # k = 2 per full chunk


def test_each_chunk_keeps_its_top_k_with_the_mean_magnitude_of_its_half() -> None:
    """Hand-computed, k = 2 per chunk of 8. Chunk 0 keeps -3 and 2 (each half is one value: its magnitude
    is kept exactly); chunk 1 keeps -4 and 1.5; chunk 2, four values tied at 1, keeps the two lowest indices;
    the last chunk, 3 values, keeps ceil(0.25 * 3) = 1."""
    x = torch.tensor(
        [0.1, -3.0, 0.5, 2.0, 0.0, 0.0, 0.0, 0.0]
        + [1.0, 0.5, -4.0, 0.0, 0.0, 1.5, 0.0, 0.2]
        + [1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        + [0.3, -0.7, 0.2]
    )
    expected = torch.tensor(
        [0.0, -3.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]
        + [0.0, 0.0, -4.0, 0.0, 0.0, 1.5, 0.0, 0.0]
        + [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        + [0.0, -0.7, 0.0]
    )
    assert SMALL.entries(x.numel()) == 2 + 2 + 2 + 1
    assert torch.equal(expand(compress(x, SMALL), SMALL, x.numel()), expected)
    assert torch.equal(decode(encode(x, IDENTITY, SMALL), IDENTITY, SMALL, x.numel()), expected)


def test_two_magnitudes_per_chunk_the_means_of_its_halves() -> None:
    """k = 4 of 8: the larger two (5, -3) both become 4, the smaller two (2, -1) both 1.5, signs kept."""
    codec = Sparse(density=0.5, chunk=8)
    x = torch.tensor([5.0, 0.1, -3.0, 2.0, 0.0, -1.0, 0.2, 0.3])
    decoded = expand(compress(x, codec), codec, 8)
    assert torch.equal(decoded, torch.tensor([4.0, 0.0, -4.0, 1.5, 0.0, -1.5, 0.0, 0.0]))


def test_the_bytes_are_what_the_layout_says_and_over_100_times_fewer_than_fp32() -> None:
    """At the default density (1.5 %): 62 entries of 14 bits and 8 bytes of magnitudes per chunk of 4,096."""
    codec = Sparse()
    numel = 1_000_000
    chunks = -(-numel // 4096)
    k = (chunks - 1) * 62 + codec.kept(numel - (chunks - 1) * 4096)
    assert data_bytes(numel, codec) == 8 * chunks + -(-k * 12 // 8) + -(-k * 2 // 8)
    payload = encode(torch.randn(numel), IDENTITY, codec)
    header, start = read_header(payload)
    assert len(payload) - start == data_bytes(numel, codec)
    assert header["__metadata__"]["density"] == "0.015" and header["__metadata__"]["chunk"] == "4096"
    assert 4 * numel / len(payload) > 130


def test_deterministic_and_the_same_through_every_reader() -> None:
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(3))
    codec = Sparse(0.02)
    a, b = encode(x, IDENTITY, codec), encode(x.clone(), IDENTITY, codec)
    assert a == b
    dense = decode(bytes(a), IDENTITY, codec, x.numel())
    total = torch.ones(x.numel())
    added, _ = accumulate(total, bytes(a), IDENTITY, codec)
    assert torch.equal(added, dense) and torch.equal(total, dense + 1)
    assert torch.equal(
        decode(encode_parts(x, IDENTITY, codec), IDENTITY, codec, x.numel(), verify=False), dense
    )
    key = RunKey(bytes(32))
    assert torch.equal(decode(encode(x, IDENTITY, codec, key), IDENTITY, codec, x.numel(), key=key), dense)
    # No more than the whole's norm: a shard's norm check holds for the sparse values it stands for.
    stated = encode(x, {**IDENTITY, NORM: repr(float(x.norm()))}, codec)
    assert measure(stated, IDENTITY, codec, x.numel()).norm <= float(x.norm())
    with pytest.raises(PayloadError, match="states no norm of the whole pseudo-gradient"):
        measure(bytes(a), IDENTITY, codec, x.numel())


def _tamper(payload: bytearray, tensor: str, data: bytes) -> bytes:
    """``payload`` with ``tensor``'s bytes replaced by ``data`` (same length) and its checksum recomputed, as a
    writer who means harm would: the checksum does not stop it, the layout checks must."""
    header, start = read_header(payload)
    begin, end = header[tensor]["data_offsets"]
    assert len(data) == end - begin
    body = bytearray(payload[start:])
    body[begin:end] = data
    header["__metadata__"][CHECKSUM] = checksum([bytes(body)])
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(body)


def test_a_payload_that_writes_a_position_twice_or_past_its_chunk_is_rejected() -> None:
    codec = SMALL
    x = torch.arange(1.0, 20.0)  # 19 values: chunks of 8, 8 and 3 (k = 2, 2, 1)
    payload = encode(x, IDENTITY, codec)
    header, start = read_header(payload)

    def index_bytes(positions: list[int]) -> bytes:
        bits = "".join(format(p, "012b")[::-1] for p in positions)
        bits += "0" * (-len(bits) % 8)
        return bytes(int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8))

    assert index_bytes([6, 7, 6, 7, 2]) == bytes(payload[start + 24 : start + 24 + 8])  # the honest one
    # The same position twice, positions out of order, a position past the last chunk's 3 values.
    for positions in ([6, 6, 6, 7, 2], [7, 6, 6, 7, 2], [6, 7, 6, 7, 3]):
        forged = _tamper(payload, "index", index_bytes(positions))
        with pytest.raises(PayloadError, match="strictly increasing"):
            decode(forged, IDENTITY, codec, x.numel())
    for magnitude in (-1.0, float("nan"), float("inf")):
        magnitudes = struct.pack("<6f", 1.0, 2.0, 1.0, 2.0, magnitude, 2.0)
        forged = _tamper(payload, "magnitudes", magnitudes)
        with pytest.raises(PayloadError, match="magnitude"):
            decode(forged, IDENTITY, codec, x.numel())


def test_a_reader_accepts_only_its_own_density_and_chunk() -> None:
    x = torch.randn(5000)
    payload = bytes(encode(x, IDENTITY, Sparse(0.015)))
    for other in (Sparse(0.02), Sparse(0.015, chunk=2048), "int8", "fp32"):
        with pytest.raises(PayloadError, match="mismatch"):
            decode(payload, IDENTITY, other, x.numel())


def test_error_feedback_sends_every_part_of_a_steady_signal() -> None:
    """A replica that sends the same pseudo-gradient g each round: what the sparse payloads carried in total
    after T rounds is T g minus the residual, and the residual stops growing (about 29 |g| here, once every
    coordinate has had its turn, some 1 / density rounds), so the sent sum's error relative to T g halves
    each time T doubles. A single payload carries only the top 1.5 % of g."""
    g = torch.randn(40_000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 2, 40_000)
    codec = Sparse()
    feedback = ErrorFeedback()
    sent = torch.zeros_like(g)
    errors, residuals = {}, {}
    for t in range(1, 401):
        sending = g + feedback.residual(0, g.numel(), 0).inputs
        out = expand(compress(sending, codec), codec, g.numel())
        sent += out
        feedback.keep(0, sending - out, None)
        if t in (200, 400):
            residual = feedback.residual(0, g.numel(), 0).inputs
            assert torch.allclose(sent + residual, t * g, rtol=1e-4, atol=1e-2)
            errors[t] = float((sent - t * g).norm() / (t * g).norm())
            residuals[t] = float(residual.norm() / g.norm())
    once = expand(compress(g, codec), codec, g.numel())
    assert float((once - g).norm() / g.norm()) > 0.9
    assert residuals[400] < 1.05 * residuals[200]
    assert errors[400] < 0.55 * errors[200] and errors[400] < 0.1


def test_the_carried_share_is_what_top_k_keeps_of_the_squared_norm() -> None:
    """1 - |unsent|^2 / |sending|^2: by hand, then the sparse codec at 1.5 % on Gaussian values (the share of
    a normal distribution's second moment beyond its 98.5th percentile of |x|, 2 (t phi(t) + 1 - Phi(t)) at
    t = 2.43: 0.116; the two-magnitude fit loses almost nothing of it) and on values whose mass sits in 1 %
    of the coordinates, most of which it carries."""
    assert carried_share(5.0, 4.0) == pytest.approx(0.36)  # sending (3, 4), (0, 4) left out
    assert carried_share(0.0, 0.0) is None
    codec = Sparse()

    def carried(x: torch.Tensor) -> float | None:
        return carried_share(
            float(x.norm()), float((x - expand(compress(x, codec), codec, x.numel())).norm())
        )

    g = torch.randn(409_600, generator=torch.Generator().manual_seed(0))
    assert carried(g) == pytest.approx(0.116, abs=0.002)
    spiky = g * 0.01
    heavy = torch.randperm(g.numel(), generator=torch.Generator().manual_seed(1))[: g.numel() // 100]
    spiky[heavy] = 10 * g[heavy]
    assert carried(spiky) > 0.7


def test_error_feedback_state_round_trips_and_clears() -> None:
    feedback = ErrorFeedback()
    feedback.residual(1, 4, 2)
    feedback.keep(1, torch.arange(4.0), None)
    feedback.residual(0, 3, 1)
    feedback.keep(0, None, torch.ones(1))
    state = feedback.state_dict()
    assert list(state) == ["0/inputs", "0/owned", "1/inputs", "1/owned"]
    restored = ErrorFeedback()
    restored.load_state_dict(state)
    assert torch.equal(restored.residual(1, 4, 2).inputs, torch.arange(4.0))
    assert torch.equal(restored.residual(0, 3, 1).owned, torch.ones(1))
    state["1/inputs"].zero_()  # the state is a copy: saving it does not alias the live residual
    assert torch.equal(feedback.residual(1, 4, 2).inputs, torch.arange(4.0))
    restored.clear()
    assert torch.equal(restored.residual(1, 4, 2).inputs, torch.zeros(4))
    restored.load_state_dict(None)
    assert restored.residuals == {}


@pytest.mark.parametrize("density", [0.015, 0.25, 0.5, 1.0])
def test_the_selection_is_what_a_stable_descending_sort_keeps(density: float) -> None:
    """The oracle: sort each chunk's magnitudes descending, stably (ties to the lower position), keep the
    first k, the first ceil(k / 2) of them in the larger class. Values rounded to halves and a zero half make
    ties at both cuts."""
    codec = Sparse(density)
    g = torch.Generator().manual_seed(4)
    x = torch.round(torch.randn(3 * 4096 + 1000, generator=g) * 2) / 2
    x[:5000] = 0
    encoded = compress(x, codec)
    decoded = expand(encoded, codec, x.numel())
    expected_positions, expected_larger = [], []
    for start in range(0, x.numel(), codec.chunk):
        chunk = x[start : start + codec.chunk]
        k = codec.kept(chunk.numel())
        order = torch.sort(chunk.abs(), descending=True, stable=True).indices[:k]
        larger = set((order[: -(-k // 2)] + start).tolist())
        for position in sorted((order + start).tolist()):
            expected_positions.append(position)
            expected_larger.append(position in larger)
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    mask[expected_positions] = True
    # Positions kept with a zero value decode to zero; every other kept position is exactly the nonzero ones.
    assert not decoded[~mask].any()
    bits = np.unpackbits(encoded.codes.numpy(), bitorder="little")[: 2 * len(expected_positions)]
    codes = torch.from_numpy(bits).view(-1, 2)
    assert codes[:, 1].bool().tolist() == expected_larger
    assert (codes[:, 0].bool() == (x[expected_positions] < 0)).all()


def test_non_finite_values_are_not_encoded() -> None:
    x = torch.randn(5000)
    x[7] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        encode(x, IDENTITY, Sparse())
