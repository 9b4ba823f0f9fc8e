"""The tensor wire format: a safetensors file whose header says whose payload it is and carries its sha256.

Anything read from a shared bucket is untrusted, so a payload is decoded only by parsing the safetensors
header (JSON) and the raw little-endian buffer; nothing is ever unpickled. A payload is accepted only if
its checksum matches and its header names exactly the run, round, fragment, rank and shard the reader
expects, so a stale, foreign, truncated or corrupted object is rejected instead of averaged.
"""

from __future__ import annotations

import hashlib
import json
import struct

import safetensors.torch
import torch

TENSOR_NAME = "delta"
_MAX_HEADER = 1 << 20


class PayloadError(ValueError):
    """A payload that must not be used: corrupt, truncated, foreign or of the wrong shape."""


def sha256_of(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()


def encode(tensor: torch.Tensor, identity: dict[str, str]) -> bytes:
    """Serialise a 1-D fp32 tensor with ``identity`` (str -> str) and its sha256 in the header."""
    flat = tensor.detach().reshape(-1).to(torch.float32).contiguous().cpu()
    metadata = {**identity, "codec": "fp32", "sha256": sha256_of(flat)}
    return safetensors.torch.save({TENSOR_NAME: flat}, metadata=metadata)


def read_header(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload, validated to be a small JSON object of strings."""
    if len(data) < 8:
        raise PayloadError(f"payload of {len(data)} bytes is too short to hold a header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > _MAX_HEADER or 8 + length > len(data):
        raise PayloadError(f"payload header length {length} does not fit a payload of {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError as e:
        raise PayloadError(f"payload header is not JSON: {e}") from e
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PayloadError("payload header has no string metadata")
    return metadata


def decode(data: bytes, expect: dict[str, str], numel: int) -> torch.Tensor:
    """Return the fp32 tensor in ``data`` after checking identity, size and checksum.

    Raises:
        PayloadError: the payload is not one this reader may average.
    """
    metadata = read_header(data)
    mismatched = {k: (metadata.get(k), v) for k, v in expect.items() if metadata.get(k) != v}
    if mismatched:
        raise PayloadError(f"payload identity mismatch (got, expected): {mismatched}")
    if metadata.get("codec") != "fp32":
        raise PayloadError(f"unsupported codec {metadata.get('codec')!r}")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error type for every malformed layout
        raise PayloadError(f"payload is not valid safetensors: {e}") from e
    tensor = tensors.get(TENSOR_NAME)
    if tensor is None or tensor.dtype != torch.float32 or tensor.numel() != numel:
        raise PayloadError(f"payload tensor does not match: expected {numel} fp32 values")
    if sha256_of(tensor) != metadata.get("sha256"):
        raise PayloadError("payload checksum mismatch")
    return tensor
