"""The tensor wire format: a safetensors file whose header says whose payload it is and carries its checksum.

Anything read from a shared bucket is untrusted, so a payload is decoded only by parsing the safetensors
header (bounded JSON) and the raw little-endian buffer; nothing is ever unpickled. A payload is accepted
only if its header names exactly the run, round, fragment, rank, shard and codec the reader expects, its
tensors have exactly the dtypes, shapes and offsets that codec and size imply, and the checksum of its data
section matches the header. A stale, foreign, truncated or corrupted object is rejected, never averaged.

The checksum is xxh3-128 (``CHECKSUM``), not a cryptographic hash: it guards against corruption in transit
or at rest, and whoever can write a payload can write its hash too, so sha256 bought no security, at 17
times the cost (1.8 against 30.7 GB/s per core, measured here), and hashing was most of an exchange's time.

With a run key (``runkey.py``, ``diloco.authenticate``) the checksum gives way to a keyed BLAKE3 MAC
(``MAC_FIELD``) over the header's metadata and the data section: it detects corruption as the checksum does,
and a payload without it, or with a wrong one, is rejected by a reader holding the key, whatever its
checksum says. The metadata is covered too, so a valid payload of another round, fragment, rank or shard
cannot be replayed under this one's name. One keyed hash per payload, as the checksum was (``runkey.py``
says why keyed BLAKE3, with its measured speed).

The header is written by hand (safetensors' own layout: an 8-byte little-endian length, JSON padded with
spaces to a multiple of 8, then the data), so the output loads with ``safetensors.torch.load`` while the
producer copies each tensor once.

Codecs (the decoded values are always fp32, and every sum over them is fp32):

* ``fp32``: exact.
* ``bf16``: round-to-nearest-even to bfloat16; half the bytes.
* ``int8``: blockwise absmax: each block of ``INT8_BLOCK`` values is scaled by its largest magnitude / 127
  and rounded to int8; the fp32 scales travel as a second tensor. About a quarter of the bytes.
* ``Sparse`` (``sparse.py``): per chunk of 4,096 values the top ``density`` of them by magnitude, as 12-bit
  chunk-local indices and 2-bit values with two fp32 magnitudes per chunk; the rest are zeros. At 1.5 %,
  about a 140th of the bytes. What it drops is the sender's to keep (``feedback.py``); the header names the
  density and chunk, and a reader accepts only its own.

An input may also carry bits for the rows of the token-indexed blocks its shard overlaps (``ROWS``, packed
eight to a byte and zlib-deflated, their count and coding in the header): in which step buckets the
replica's data held each token (``rows.py``). A reader that expects them (``rows`` > 0) accepts only a payload
with exactly that many, in one zlib stream no longer than zlib's bound for them, which it never inflates past
their size; one that expects none, only a payload without.

An input (one shard of a replica's pseudo-gradient) states the L2 norm of the whole pseudo-gradient it is
a shard of (``NORM``; ``measure`` rejects an input without it): a shard's owner sees only its shard, and a robust average compares whole contributions
(``robust.py``). ``measure`` holds the claim to the shard's own values: a shard cannot be larger than the
whole it is part of.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import xxhash

from composer_serverless.rendezvous import sparse
from composer_serverless.rendezvous.rows import deflate, deflated_bound, inflate
from composer_serverless.rendezvous.runkey import MAC_FIELD, RunKey, framed
from composer_serverless.rendezvous.sparse import Sparse

CodecName = Literal["fp32", "bf16", "int8"]
CODECS: tuple[CodecName, ...] = ("fp32", "bf16", "int8")
# A wire codec: a dense one by name, or the sparse codec with its density.
Codec = CodecName | Sparse
VALUES = "values"
SCALES = "scales"
ROWS = "rows"
ROWS_CODING = "rows_coding"
# The sparse codec's tensors (``sparse.Encoded``).
INDEX = "index"
CODES = "codes"
MAGNITUDES = "magnitudes"
INT8_BLOCK = 256
# The header field that holds the data section's checksum, and the checksum: xxh3-128, hex.
CHECKSUM = "xxh3_128"
# The header field of an input that states its whole pseudo-gradient's L2 norm (``repr`` of a float).
NORM = "norm"
# How far a shard's decoded norm may exceed the norm its header states for the whole: a lossy codec's rounding
# can enlarge a shard a little (int8 by a few per cent in the worst block), nothing honest by a quarter.
NORM_SLACK = 1.25
NON_FINITE = "payload holds non-finite values (NaN or Inf)"


def checksum(parts: Iterable[bytes | bytearray | memoryview]) -> str:
    """xxh3-128 of the concatenation of ``parts``, hex (what ``CHECKSUM`` holds)."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.hexdigest()


# Our headers are a few hundred bytes; the bound keeps a hostile length field from costing memory.
MAX_HEADER_BYTES = 1 << 14

_DTYPES = {"fp32": ("F32", torch.float32), "bf16": ("BF16", torch.bfloat16), "int8": ("I8", torch.int8)}

# A payload as read from a store, or as ``encode_parts`` returns it (header first, then the tensors' bytes).
Payload = bytes | bytearray | memoryview | list[memoryview]


class PayloadError(ValueError):
    """A payload that must not be used: corrupt, truncated, foreign, or of the wrong codec or shape."""


def data_bytes(numel: int, codec: Codec, rows: int = 0) -> int:
    """Size of the data section (everything after the header) of a payload of ``numel`` values; with ``rows``
    row bits, the most it can be (their deflated size varies with the bits)."""
    if isinstance(codec, Sparse):
        return sum(codec.sizes(numel)) + _most_row_bytes(rows)
    if codec == "int8":
        return numel + 4 * _blocks(numel) + _most_row_bytes(rows)
    return numel * _DTYPES[codec][1].itemsize + _most_row_bytes(rows)


def _most_row_bytes(rows: int) -> int:
    """The most bytes ``rows`` deflated row bits take: what a reader allocates for them."""
    return deflated_bound(rows) if rows else 0


def max_payload_bytes(numel: int, codec: Codec, rows: int = 0) -> int:
    """An upper bound on the size of a valid payload: the buffer a reader preallocates."""
    return 8 + MAX_HEADER_BYTES + data_bytes(numel, codec, rows)


def quantize_int8(values: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8: returns (int8 values, one fp32 scale per block). Deterministic: the same input
    gives the same bytes on every machine, which is what lets any replica re-reduce a shard identically."""
    n = values.numel()
    blocks = _blocks(n, block)
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:n] = values
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n].contiguous(), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    n = q.numel()
    blocks = scales.numel()
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:n] = q.to(torch.float32)
    return (padded.view(blocks, block) * scales[:, None]).view(-1)[:n].contiguous()


def encode(
    values: torch.Tensor,
    identity: dict[str, str],
    codec: Codec,
    key: RunKey | None = None,
    rows: torch.Tensor | None = None,
) -> bytearray:
    """Serialise a 1-D fp32 tensor with ``codec`` (and ``rows``' row bits); ``identity`` (str -> str) goes
    into the header, with the checksum, or with ``key`` the MAC.

    Returns a buffer that is a valid safetensors file.
    """
    return bytearray().join(encode_parts(values, identity, codec, key, rows))


def encode_parts(
    values: torch.Tensor,
    identity: dict[str, str],
    codec: Codec,
    key: RunKey | None = None,
    rows: torch.Tensor | None = None,
) -> list[memoryview]:
    """The payload ``encode`` returns, as the buffers it joins: the header, then each tensor's bytes.

    ``rows``: row bits to carry (a bool tensor, ``rows.py``); none when None or empty.

    A writer that can send several buffers (a local file) skips the join; with fp32 the tensor part is
    ``values``' own memory, so nothing is copied before the write. The parts alias ``values``: it must not
    change until they are written.
    """
    flat = values.detach().reshape(-1).to(torch.float32).contiguous().cpu()
    numel = flat.numel()
    if isinstance(codec, Sparse):
        kept = sparse.compress(flat, codec)
        tensors = [(MAGNITUDES, "F32", kept.magnitudes), (INDEX, "U8", kept.index), (CODES, "U8", kept.codes)]
    elif codec == "int8":
        q, scales = quantize_int8(flat)
        tensors = [(VALUES, "I8", q), (SCALES, "F32", scales)]
    else:
        name, dtype = _DTYPES[codec]
        tensors = [(VALUES, name, flat.to(dtype))]
    metadata = {**identity, **_codec_fields(codec), "numel": str(numel)}
    if rows is not None and rows.numel():
        tensors.append((ROWS, "U8", deflate(rows)))
        metadata.update({ROWS: str(rows.numel()), ROWS_CODING: "zlib"})
    data = [_bytes_of(t) for _, _, t in tensors]
    if key is None:
        metadata[CHECKSUM] = checksum(data)
    else:
        metadata[MAC_FIELD] = key.mac(_mac_input(metadata, data))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype_name, t in tensors:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name, "shape": [t.numel()], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [memoryview(struct.pack("<Q", len(raw)) + raw), *data]


def _codec_fields(codec: Codec) -> dict[str, str]:
    """The header fields that name a payload's codec; a reader expects exactly its own."""
    if isinstance(codec, Sparse):
        return {"codec": str(codec), "density": repr(codec.density), "chunk": str(codec.chunk)}
    return {"codec": codec}


def _mac_input(metadata: dict[str, str], data: list[memoryview]) -> list[bytes | memoryview]:
    """What a payload's MAC covers: every metadata field but the MAC (sorted, each framed by its length),
    then the data section."""
    fields = sorted((k, v) for k, v in metadata.items() if k != MAC_FIELD)
    return [struct.pack("<Q", len(fields)), *(framed(k) + framed(v) for k, v in fields), *data]


def read_header(data: bytes | bytearray | memoryview) -> tuple[dict[str, object], int]:
    """The parsed safetensors header and where the data section starts; the JSON is bounded and checked.

    Raises:
        PayloadError: the bytes do not start with a plausible safetensors header (a pickle or a
            ``torch.save`` zip fails here, before anything else is looked at).
    """
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise PayloadError(f"payload of {len(view)} bytes is too short to hold a header")
    (length,) = struct.unpack("<Q", view[:8])
    if length > MAX_HEADER_BYTES or 8 + length > len(view):
        raise PayloadError(f"header length {length} does not fit a payload of {len(view)} bytes")
    try:
        header = json.loads(bytes(view[8 : 8 + length]))
    except ValueError as e:
        raise PayloadError(f"payload header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise PayloadError("payload header is not a JSON object")
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PayloadError("payload header has no string metadata")
    return header, 8 + length


def decode(
    data: Payload,
    expect: dict[str, str],
    codec: Codec,
    numel: int,
    out: torch.Tensor | None = None,
    *,
    verify: bool = True,
    key: RunKey | None = None,
    rows: int = 0,
) -> torch.Tensor:
    """Return the fp32 values in ``data`` after checking identity, codec, layout, size and checksum.

    Args:
        data: the payload (a buffer may be longer than the payload only if ``data`` is sliced first), or
            ``encode_parts``' parts of it.
        expect: header fields that must match exactly (run id, round, fragment, rank, shard).
        codec: the codec the run uses; a payload in any other codec is rejected.
        numel: the number of values the reader expects.
        out: an fp32 tensor of ``numel`` values to decode into (saves a copy); a new one if None.
        verify: check the checksum (or MAC). Only a payload this process encoded itself, in memory, may skip
            it: the checksum guards what crossed the store, and hashing is most of a decode's cost.
        key: the run key: the payload must carry a valid MAC under it (a checksum alone is rejected).
        rows: the row bits it must carry (``accumulate``), which are not returned.

    Raises:
        PayloadError: the payload is not one this reader may average.
    """
    values = _checked(data, expect, codec, numel, verify, key, rows=rows)[0]
    if out is None:
        return values.to(torch.float32) if codec == "bf16" else values.clone() if codec == "fp32" else values
    return out.copy_(values)


def accumulate(
    total: torch.Tensor,
    data: Payload,
    expect: dict[str, str],
    codec: Codec,
    *,
    verify: bool = True,
    key: RunKey | None = None,
    rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the payload's values to the fp32 tensor ``total``, checked as ``decode`` checks them (and that it
    carries exactly ``rows`` row bits); returns the values added (a view of ``data`` for fp32) and the row
    bits (a bool tensor, empty without rows), for a reducer that also averages rows (``rows.RowSums``).

    A reducer sums N payloads of a shard; adding straight from the payload's buffer skips the copy
    ``decode`` makes, and on a box where replicas share cores that copy is CPU the exchange waits for. The
    sum is the same, bit for bit: the fp32 (or exactly widened bf16) values are added in the same order.

    Raises:
        PayloadError: as ``decode``; ``total`` is then unchanged.
    """
    values, _, bits = _checked(data, expect, codec, total.numel(), verify, key, rows=rows)
    total.add_(values)
    return values, bits


def l2_norm(values: torch.Tensor) -> float:
    """The L2 norm of fp32 ``values``, computed in fp32 (one fast pass) unless that overflows, as values near
    1e19 do: then in fp64, which holds the norm of any finite fp32 values. NaN or Inf if any value is."""
    norm = float(torch.linalg.vector_norm(values))
    return norm if math.isfinite(norm) else float(torch.linalg.vector_norm(values, dtype=torch.float64))


@dataclass(frozen=True)
class Measured:
    """A checked input's size: the norm of its own values, and the norm of the whole pseudo-gradient its
    header states."""

    norm: float
    whole: float


def measure(
    data: Payload,
    expect: dict[str, str],
    codec: Codec,
    numel: int,
    *,
    verify: bool = True,
    key: RunKey | None = None,
    rows: int = 0,
) -> Measured:
    """Check a payload as ``decode`` does and measure it (one more pass over its values).

    Raises:
        PayloadError: as ``decode``; or it states no ``NORM``, or one that is not a finite non-negative
            number, or smaller than the norm of its own values (beyond ``NORM_SLACK``): a shard cannot outweigh
            its whole.
    """
    values, metadata, _ = _checked(data, expect, codec, numel, verify, key, finite=False, rows=rows)
    norm = l2_norm(values)  # NaN or Inf exactly when a value is: the finiteness check's pass, spared
    if not math.isfinite(norm):
        raise PayloadError(NON_FINITE)
    if NORM not in metadata:
        raise PayloadError(
            "payload states no norm of the whole pseudo-gradient it is part of; every input states one"
        )
    try:
        whole = float(metadata[NORM])
    except ValueError:
        whole = math.nan
    if not (math.isfinite(whole) and whole >= 0):
        raise PayloadError(f"payload states a norm of {metadata[NORM]!r}, not a finite non-negative number")
    if norm > whole * NORM_SLACK and norm - whole > 1e-30:
        raise PayloadError(
            f"payload values have norm {norm:.4g}, more than the norm {whole:.4g} its header states for the "
            "whole pseudo-gradient they are part of"
        )
    return Measured(norm, whole)


def _checked(
    data: Payload,
    expect: dict[str, str],
    codec: Codec,
    numel: int,
    verify: bool,
    key: RunKey | None,
    *,
    finite: bool = True,
    rows: int = 0,
) -> tuple[torch.Tensor, dict[str, str], torch.Tensor]:
    """The payload's values after every check (that they are finite only with ``finite``: a caller that
    measures them anyway checks it there), its header's metadata, and its ``rows`` row bits."""
    header, body = _header_and_body(data)
    metadata = header["__metadata__"]
    assert isinstance(metadata, dict)
    wanted = {**expect, **_codec_fields(codec), "numel": str(numel)}
    if rows:
        wanted.update({ROWS: str(rows), ROWS_CODING: "zlib"})
    mismatched = {k: (metadata.get(k), v) for k, v in wanted.items() if metadata.get(k) != v}
    if mismatched:
        raise PayloadError(f"payload header mismatch (got, expected): {mismatched}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    row_bytes = _row_bytes(tensors, rows)
    layout = _layout(numel, codec, row_bytes)
    if tensors != layout:
        raise PayloadError(
            f"payload tensors {tensors} are not the {codec} layout of {numel} values and {rows} row bits {layout}"
        )
    size = data_bytes(numel, codec) + row_bytes
    if len(body) != size:
        raise PayloadError(f"payload data is {len(body)} bytes, expected {size}")
    if verify and key is not None:
        if MAC_FIELD not in metadata:
            raise PayloadError("payload carries no MAC, and this run authenticates every payload")
        if not key.verify(metadata[MAC_FIELD], _mac_input(metadata, [body])):
            raise PayloadError("payload MAC mismatch: not written with this run's key, or corrupted")
    elif verify and checksum([body]) != metadata.get(CHECKSUM):
        raise PayloadError("payload checksum mismatch")
    if isinstance(codec, Sparse):
        values = _expanded(body, codec, numel)
    elif codec == "int8":
        values = dequantize_int8(
            _view(body, torch.int8, 0, numel), _view(body, torch.float32, numel, _blocks(numel))
        )
    else:
        values = _view(body, _DTYPES[codec][1], 0, numel)
    # A checksum proves the bytes arrived as written, not that they are numbers: one NaN or Inf averaged in
    # makes every parameter it touches NaN, on every replica, for good.
    if finite and not _finite(values):
        raise PayloadError(NON_FINITE)
    bits = torch.zeros(0, dtype=torch.bool)
    if rows:
        try:
            bits = inflate(body[len(body) - row_bytes :], rows)
        except ValueError as e:
            raise PayloadError(str(e)) from e
    return values, metadata, bits


def _finite(values: torch.Tensor) -> bool:
    """Whether every value is finite. Their sum is one fast reduction and is non-finite if any value is
    (NaN and Inf propagate); only a sum that overflowed from finite values needs the element-wise check."""
    return math.isfinite(float(values.sum())) or bool(torch.isfinite(values).all())


def _header_and_body(data: Payload) -> tuple[dict[str, object], memoryview]:
    """The parsed header and the data section, of a whole payload or of ``encode_parts``' parts (whose
    single tensor part is used where it lies; several are joined: int8's, a quarter of the fp32 size, or
    values followed by row bits)."""
    if isinstance(data, list):
        head = memoryview(data[0]).cast("B")
        header, start = read_header(head)
        if start != len(head):
            raise PayloadError(f"header part is {len(head)} bytes, its header {start}")
        tensors = data[1:]
        body = memoryview(tensors[0]).cast("B") if len(tensors) == 1 else memoryview(b"".join(tensors))
        return header, body
    view = memoryview(data).cast("B")
    header, start = read_header(view)
    return header, view[start:]


def _expanded(body: memoryview, codec: Sparse, numel: int) -> torch.Tensor:
    """The dense values of a sparse payload whose layout is checked."""
    magnitudes, index, codes = codec.sizes(numel)
    encoded = sparse.Encoded(
        index=_view(body, torch.uint8, magnitudes, index),
        codes=_view(body, torch.uint8, magnitudes + index, codes),
        magnitudes=_view(body, torch.float32, 0, magnitudes // 4),
    )
    try:
        return sparse.expand(encoded, codec, numel)
    except ValueError as e:
        raise PayloadError(str(e)) from e


def _layout(numel: int, codec: Codec, row_bytes: int = 0) -> dict[str, dict[str, object]]:
    """The tensors a payload of ``numel`` values has, with ``row_bytes`` bytes of deflated row bits."""
    if isinstance(codec, Sparse):
        out: dict[str, dict[str, object]] = {}
        offset = 0
        for name, dtype, size in zip(
            (MAGNITUDES, INDEX, CODES), ("F32", "U8", "U8"), codec.sizes(numel), strict=True
        ):
            count = size // 4 if dtype == "F32" else size
            out[name] = {"dtype": dtype, "shape": [count], "data_offsets": [offset, offset + size]}
            offset += size
    elif codec == "int8":
        blocks = _blocks(numel)
        out = {
            VALUES: {"dtype": "I8", "shape": [numel], "data_offsets": [0, numel]},
            SCALES: {"dtype": "F32", "shape": [blocks], "data_offsets": [numel, numel + 4 * blocks]},
        }
    else:
        name, dtype = _DTYPES[codec]
        out = {VALUES: {"dtype": name, "shape": [numel], "data_offsets": [0, numel * dtype.itemsize]}}
    if row_bytes:
        end = data_bytes(numel, codec)
        out[ROWS] = {"dtype": "U8", "shape": [row_bytes], "data_offsets": [end, end + row_bytes]}
    return out


def _row_bytes(tensors: dict[str, object], rows: int) -> int:
    """How many bytes of deflated row bits the header says the payload carries: 0 without ``rows``; with them,
    a whole number from 1 to zlib's bound for ``rows`` bits (anything else is refused by the layout check)."""
    if not rows:
        return 0
    entry = tensors.get(ROWS)
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if (
        isinstance(shape, list)
        and len(shape) == 1
        and type(shape[0]) is int
        and 0 < shape[0] <= deflated_bound(rows)
    ):
        return shape[0]
    raise PayloadError(
        f"payload row bits {entry} are not 1 to {deflated_bound(rows)} bytes of {rows} deflated bits"
    )


def _view(body: memoryview, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """A tensor over ``count`` values of ``body`` at byte ``offset``, without copying. Callers only read it
    (and copy or convert at once), so the warning torch gives for read-only buffers such as ``bytes`` is
    noise here."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(body, dtype=dtype, offset=offset, count=count)


def _blocks(numel: int, block: int = INT8_BLOCK) -> int:
    return -(-numel // block)


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
