"""Averaging token-indexed rows over the replicas whose data held the token (``rendezvous/rows.py``), in the
codec and through the store's all-reduce: hand-computed sums, bit for bit."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from test_allreduce import NUMEL, exchange, tensors

from composer_serverless.rendezvous import codec
from composer_serverless.rendezvous.codec import PayloadError, accumulate, data_bytes, encode, measure
from composer_serverless.rendezvous.exchange import ExchangeSettings
from composer_serverless.rendezvous.rows import (
    RowBlock,
    RowMask,
    RowSums,
    Span,
    deflate,
    deflated_bound,
    inflate,
    pack,
    spans,
    unpack,
)
from composer_serverless.rendezvous.sharding import shard_bounds


def test_spans_are_the_rows_that_overlap_a_shard_with_where_they_start() -> None:
    blocks = (RowBlock(offset=300, rows=20, width=7), RowBlock(offset=900, rows=10, width=10, first_token=5))
    # Shard [333, 667): row (333 - 300) // 7 = 4 begins at 328, 5 values before the shard; the block ends at 440.
    assert spans(blocks, 333, 667) == [Span(block=0, row=4, count=16, start=-5, width=7)]
    assert spans(blocks, 0, 333) == [Span(block=0, row=0, count=5, start=300, width=7)]
    assert spans(blocks, 667, 1001) == [Span(block=1, row=0, count=10, start=233, width=10)]
    assert spans(blocks, 440, 900) == []


def test_bits_pack_eight_to_a_byte_lowest_first() -> None:
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert pack(bits).tolist() == [129, 3]
    assert torch.equal(unpack(pack(bits), 10), bits)


def test_bits_travel_deflated_and_inflate_to_exactly_what_was_sent() -> None:
    # A 2,048-row block of 10 buckets where the data held the first 100 tokens at every step: 2,560 packed
    # bytes, mostly runs of zeros.
    bits = torch.zeros(2048, 10, dtype=torch.bool)
    bits[:100] = True
    bits = bits.reshape(-1)
    deflated = deflate(bits)
    assert deflated.numel() < 40 and torch.equal(inflate(deflated.numpy().tobytes(), bits.numel()), bits)
    # Incompressible bits reach zlib's bound and no further; one bit takes one byte and zlib's 13.
    noise = torch.rand(20_480, generator=torch.Generator().manual_seed(0)) < 0.5
    assert 2560 < deflate(noise).numel() <= deflated_bound(20_480) == 2560 + 13
    assert deflated_bound(1) == 14
    assert torch.equal(inflate(memoryview(deflate(noise).numpy()), 20_480), noise)


def test_inflate_refuses_anything_but_one_stream_of_the_expected_size() -> None:
    bits = torch.ones(80, dtype=torch.bool)
    good = deflate(bits).numpy().tobytes()
    with pytest.raises(ValueError, match=r"not one zlib stream of 9 bytes \(72 bits\)"):
        inflate(good, 72)  # inflates past the 9 bytes of 72 bits: refused without inflating the rest
    with pytest.raises(ValueError, match="not one zlib stream"):
        inflate(good, 88)  # inflates to fewer
    with pytest.raises(ValueError, match="not one zlib stream"):
        inflate(good + b"\x00", 80)  # trailing bytes
    with pytest.raises(ValueError, match="not one zlib stream"):
        inflate(good[:-3], 80)  # cut short
    with pytest.raises(ValueError, match="do not inflate"):
        inflate(b"not zlib at all", 80)
    # A stream that would inflate to a gigabyte stops at the bytes asked for.
    bomb = zlib.compress(bytes(1 << 30), 9)
    with pytest.raises(ValueError, match="not one zlib stream of 10 bytes"):
        inflate(bomb, 80)


def test_a_payload_whose_row_bits_do_not_inflate_to_their_count_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Written with a valid checksum (the writer's own bytes), so only the row-bit checks can catch it."""
    values = torch.arange(12, dtype=torch.float32)
    bits = torch.tensor([True, False, True], dtype=torch.bool)
    monkeypatch.setattr(codec, "deflate", lambda b: deflate(torch.cat([b, b, b, b])))  # 12 bits for 3
    wrong = encode(values, {"rank": "0"}, "fp32", rows=bits)
    with pytest.raises(PayloadError, match="not one zlib stream"):
        accumulate(torch.zeros(12), wrong, {"rank": "0"}, "fp32", rows=3)
    monkeypatch.setattr(
        codec, "deflate", lambda b: torch.zeros(deflated_bound(b.numel()) + 1, dtype=torch.uint8)
    )
    too_long = encode(values, {"rank": "0"}, "fp32", rows=bits)
    with pytest.raises(PayloadError, match="not 1 to 14 bytes of 3 deflated bits"):
        accumulate(torch.zeros(12), too_long, {"rank": "0"}, "fp32", rows=3)


def test_row_sums_average_each_row_over_the_inputs_that_touched_it() -> None:
    # One block of 3 rows of width 2 at the start of a 7-value shard; the last value lies outside any row.
    sums = RowSums([Span(block=0, row=0, count=3, start=0, width=2)], numel=7, buckets=1)
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    b = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0])
    sums.add(a, torch.tensor([True, True, False]))
    sums.add(b, torch.tensor([False, True, False]))
    average = (a + b) / 2
    sums.apply(average)
    # Row 0: only a touched it; row 1: both (their mean); row 2: neither (the plain mean stays); value 6: no row.
    assert average.tolist() == [1.0, 2.0, 16.5, 22.0, 27.5, 33.0, 38.5]


def test_a_row_takes_its_per_bucket_rate_times_the_buckets_any_input_held_it_in() -> None:
    """Two step buckets. Row 0: both inputs held the token in both buckets (4 bucket-holdings, 2 buckets):
    the mean. Row 1: a in bucket 0, b in bucket 1: one process would have seen the token in both, so the sum.
    Row 2: a in both buckets, b in bucket 1 (3 holdings over 2 buckets): 2/3 of the sum."""
    sums = RowSums([Span(block=0, row=0, count=3, start=0, width=1)], numel=3, buckets=2)
    a, b = torch.tensor([3.0, 5.0, 6.0]), torch.tensor([9.0, 7.0, 3.0])
    sums.add(a, torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.bool).reshape(-1))
    sums.add(b, torch.tensor([[1, 1], [0, 1], [0, 1]], dtype=torch.bool).reshape(-1))
    average = (a + b) / 2
    sums.apply(average)
    assert average.tolist() == [6.0, 12.0, 6.0]


def test_a_payload_carries_exactly_the_row_bits_its_reader_expects() -> None:
    values = torch.arange(12, dtype=torch.float32)
    bits = torch.tensor([True, False, True], dtype=torch.bool)
    payload = encode(values, {"rank": "0"}, "int8", rows=bits)
    # int8 values, one scale, and at most three bits in one byte deflated (zlib's bound: 1 + 13)
    assert data_bytes(12, "int8", 3) == 12 + 4 + 14
    total = torch.zeros(12)
    added, got = accumulate(total, payload, {"rank": "0"}, "int8", rows=3)
    assert torch.equal(got, bits) and torch.equal(total, added)
    with pytest.raises(PayloadError, match="mismatch"):
        measure(payload, {"rank": "0"}, "int8", 12, rows=4)
    with pytest.raises(PayloadError, match="layout"):
        measure(payload, {"rank": "0"}, "int8", 12)
    with pytest.raises(PayloadError, match="mismatch"):
        measure(encode(values, {"rank": "0"}, "int8"), {"rank": "0"}, "int8", 12, rows=3)


def expected(values: dict[int, torch.Tensor], masks: dict[int, RowMask]) -> torch.Tensor:
    """By hand, for masks of one step bucket: the plain mean (rank order, fp32) everywhere, except that an
    element of a row whose token some replicas' data held is the mean over just those replicas."""
    ranks = sorted(values)
    total = torch.zeros(NUMEL)
    for r in ranks:
        total += values[r]
    out = total / len(ranks)
    blocks = masks[ranks[0]].blocks
    for block in blocks:
        for row in range(block.rows):
            token = block.first_token + row
            held = [r for r in ranks if masks[r].touched[token, 0]]
            if not held:
                continue
            lo, hi = block.offset + row * block.width, block.offset + (row + 1) * block.width
            part = torch.zeros(hi - lo)
            for r in held:
                part += values[r][lo:hi]
            out[lo:hi] = part / len(held)
    return out


def test_every_replica_averages_each_row_over_the_replicas_that_trained_it(tmp_path: Path) -> None:
    values = tensors(3)
    # A tied embedding split over two shards (row 4 straddles the boundary at 333) and an untied head's slice
    # of rows 5-14 (as an FSDP rank holds); 20 tokens, each replica's data held a different few.
    blocks = (RowBlock(offset=300, rows=20, width=7), RowBlock(offset=900, rows=10, width=10, first_token=5))
    held = {0: [0, 4, 5, 9], 1: [4, 9, 12], 2: [4, 19]}
    masks = {}
    for r, tokens in held.items():
        touched = torch.zeros(20, 1, dtype=torch.bool)
        touched[tokens] = True
        masks[r] = RowMask(blocks, touched)
    settings = ExchangeSettings(replicas=3, min_replicas=3, codec="fp32", timeout_s=60)
    results = exchange(f"file://{tmp_path}/run", values, settings, grace=10, rows=masks)
    want = expected(values, masks)
    assert not torch.equal(
        want, expected(values, {r: RowMask(blocks, torch.zeros(20, 1, dtype=torch.bool)) for r in masks})
    )
    for result in results.values():
        assert torch.equal(result.average, want)
    # What the bits cost: each replica's three inputs carry 5 + 16 + 10 bits, deflated to 9-11 bytes each
    # (zlib's framing is most of it at this size), and their headers name them and their coding (about 90
    # bytes with the padding), against 4 x 1001 bytes of values.
    plain = exchange(f"file://{tmp_path}/plain", values, settings, grace=10)
    extra = results[0].bytes_up - plain[0].bytes_up
    assert 3 * 90 < extra <= 3 * 115


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_rows_average_under_a_lossy_codec_and_replicas_stay_identical(tmp_path: Path, codec: str) -> None:
    values = tensors(4)
    blocks = (RowBlock(offset=0, rows=100, width=8),)
    masks = {r: RowMask(blocks, (torch.arange(100) % 4 == r)[:, None]) for r in range(4)}
    settings = ExchangeSettings(replicas=4, min_replicas=4, codec=codec, timeout_s=60)
    results = exchange(f"file://{tmp_path}/run", values, settings, grace=10, rows=masks)
    first = results[0].average
    assert all(torch.equal(r.average, first) for r in results.values())
    # Each row was held by one replica: its average is that replica's values (through the codec twice).
    for r in range(4):
        row = 4 + r
        mine = values[r][row * 8 : (row + 1) * 8]
        assert torch.allclose(first[row * 8 : (row + 1) * 8], mine, rtol=0.02, atol=0.02)
    assert shard_bounds(NUMEL, 4)[0] == (0, 250)
