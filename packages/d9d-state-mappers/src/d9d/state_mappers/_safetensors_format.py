"""The safetensors file layout: an 8-byte little-endian header length, a JSON header, then data.

Each header entry gives a tensor's dtype, shape and ``[begin, end)`` byte offsets into the data
region; ``__metadata__`` holds string metadata. Headers are padded with spaces to 8 bytes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from d9d.state_mappers._errors import CheckpointFormatError
from d9d.state_mappers._spec import TensorSpec

_MAX_HEADER_BYTES = 100 * 2**20

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class StoredTensor:
    """Where one tensor lies in a safetensors file."""

    spec: TensorSpec
    offset: int
    """Absolute byte offset of the tensor's first byte in the file."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors")
    return DTYPE_NAMES[dtype]


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Parses and checks a safetensors file's header; reads no tensor data.

    Raises:
        CheckpointFormatError: If the file is missing, truncated, or its header is malformed;
            the message names the file (and the tensor, where one is at fault).
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointFormatError(f"{path}: truncated ({size} bytes, no safetensors header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointFormatError(
                    f"{path}: corrupt or truncated: header length {header_len} "
                    f"does not fit a {size}-byte file"
                )
            raw = f.read(header_len)
    except FileNotFoundError as error:
        raise CheckpointFormatError(f"{path}: file not found") from error
    try:
        header: Any = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointFormatError(f"{path}: corrupt header: {error}") from error
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupt header: not a JSON object")
    data_start = 8 + header_len
    data_size = size - data_start
    out: dict[str, StoredTensor] = {}
    entries = cast(dict[str, Any], header)
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        stored = _parse_entry(path, name, entry, data_start)
        end = stored.offset - data_start + stored.spec.nbytes
        if end > data_size:
            raise CheckpointFormatError(
                f"{path}: truncated: tensor {name!r} ends at data byte {end} but the file holds {data_size}"
            )
        out[name] = stored
    return out


def _parse_entry(path: Path, name: str, entry: Any, data_start: int) -> StoredTensor:
    try:
        dtype_str = entry["dtype"]
        shape = [int(s) for s in entry["shape"]]
        begin, end = (int(v) for v in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointFormatError(f"{path}: corrupt header entry for tensor {name!r}: {entry!r}") from error
    if dtype_str not in DTYPES:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has unsupported dtype {dtype_str!r}")
    dtype = DTYPES[dtype_str]
    if any(s < 0 for s in shape) or begin < 0 or end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointFormatError(
            f"{path}: corrupt header entry for tensor {name!r}: shape {shape} of {dtype_str} does not "
            f"match byte range [{begin}, {end})"
        )
    return StoredTensor(spec=TensorSpec(shape=tuple(shape), dtype=dtype), offset=data_start + begin)


def build_header(entries: list[tuple[str, TensorSpec]]) -> tuple[bytes, dict[str, int]]:
    """A header for tensors laid out back to back in the given order.

    Returns:
        The padded header bytes (with the 8-byte length prefix) and each tensor's absolute byte
        offset in the file.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    relative: dict[str, int] = {}
    cursor = 0
    for name, spec in entries:
        header[name] = {
            "dtype": dtype_name(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [cursor, cursor + spec.nbytes],
        }
        relative[name] = cursor
        cursor += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    return prefix, {name: len(prefix) + offset for name, offset in relative.items()}
