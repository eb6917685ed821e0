"""``d9d inspect``: what a DCP checkpoint or a safetensors export holds, as a table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from d9d.loop.cli._checkpoint_check import read_checkpoint_metadata, verify_checkpoint
from d9d.loop.cli._errors import CommandError


@dataclass(kw_only=True, frozen=True)
class TensorEntry:
    """One stored tensor: its name, dtype, shape and size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @staticmethod
    def of(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorEntry:
        """The entry of a tensor of ``dtype`` and ``shape``."""
        return TensorEntry(
            name=name,
            dtype=str(dtype).removeprefix("torch."),
            shape=shape,
            nbytes=_numel(shape) * torch.empty((), dtype=dtype).element_size(),
        )


@dataclass(kw_only=True)
class Inspection:
    """What a path holds: the kind, its facts (step, layout, config), its tensors and other entries."""

    kind: str
    facts: dict[str, str]
    tensors: list[TensorEntry]
    other: list[str]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def inspect_dcp(path: Path) -> Inspection:
    """A DCP checkpoint's tensors from its ``.metadata`` (a pickle: a checkpoint is trusted input).

    Raises:
        CommandError: If ``.metadata`` is unreadable or the checkpoint is damaged (a file
            missing, truncated or differing from its manifest record), naming the files.
    """
    metadata = read_checkpoint_metadata(path)
    manifest = verify_checkpoint(path, metadata)
    tensors: list[TensorEntry] = []
    other: list[str] = []
    for name, entry in sorted(metadata.state_dict_metadata.items()):
        if isinstance(entry, TensorStorageMetadata):
            tensors.append(TensorEntry.of(name, entry.properties.dtype, tuple(int(s) for s in entry.size)))
        else:
            other.append(name)
    facts = {"checkpoint": str(path)}
    if manifest is not None:
        facts["step"] = str(manifest.step)
        facts["global batch size"] = str(manifest.layout.global_batch_size)
        facts["optimizer"] = manifest.layout.optimizer
        facts["files"] = f"{len(manifest.files)}, sizes and CRC-32 as the manifest records"
    else:
        facts["files"] = "no manifest (an older d9d wrote it): checked for truncation only"
    if manifest is None and path.name.startswith("step_") and path.name.removeprefix("step_").isdigit():
        facts["step"] = str(int(path.name.removeprefix("step_")))
    facts["config"] = "not stored in a DCP checkpoint: the job's YAML (d9d export reads it)"
    return Inspection(kind="DCP checkpoint", facts=facts, tensors=tensors, other=other)


def _safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype name and shape from a safetensors file's JSON header (no data read)."""
    try:
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length < 100_000_000:
                raise ValueError(f"header length {length}")
            header: Any = json.loads(handle.read(length))
        entries = cast(dict[str, Any], header)
        return {
            name: (str(entry["dtype"]), tuple(int(s) for s in entry["shape"]))
            for name, entry in entries.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CommandError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from e


def inspect_safetensors(path: Path) -> Inspection:
    """A safetensors file's or directory's tensors (headers only) and its ``config.json``."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise CommandError(f"{path} holds no .safetensors file")
    tensors: list[TensorEntry] = []
    for file in files:
        for name, (dtype_name, shape) in _safetensors_header(file).items():
            tensors.append(TensorEntry.of(name, _SAFETENSORS_DTYPES.get(dtype_name, torch.uint8), shape))
    facts = {"files": str(len(files))}
    config_file = (path if path.is_dir() else path.parent) / "config.json"
    if config_file.exists():
        try:
            config: Any = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CommandError(f"{config_file} is not valid JSON: {e}") from e
        if isinstance(config, dict):
            shown = {
                k: v
                for k, v in cast(dict[str, Any], config).items()
                if isinstance(v, str | int | float | bool)
            }
            facts["config"] = f"{config_file.name}: " + ", ".join(
                f"{k}={v}" for k, v in sorted(shown.items())
            )
    return Inspection(
        kind="safetensors", facts=facts, tensors=sorted(tensors, key=lambda t: t.name), other=[]
    )


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def inspect_path(path: Path) -> Inspection:
    """Inspects a DCP checkpoint directory (it has ``.metadata``) or safetensors file/directory.

    Raises:
        CommandError: If the path is missing or is neither, naming it.
    """
    if not path.exists():
        raise CommandError(f"{path} does not exist")
    if path.is_dir() and (path / ".metadata").is_file():
        return inspect_dcp(path)
    if path.suffix == ".safetensors" or (path.is_dir() and any(path.glob("*.safetensors"))):
        return inspect_safetensors(path)
    raise CommandError(f"{path} is neither a DCP checkpoint (no .metadata) nor safetensors")


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def format_inspection(inspection: Inspection) -> str:
    """The inspection as text: the facts, then a table of tensors and a total."""
    lines = [f"{inspection.kind}"]
    lines += [f"  {key}: {value}" for key, value in inspection.facts.items()]
    header = ("tensor", "dtype", "shape", "size")
    rows = [
        (t.name, t.dtype, "x".join(map(str, t.shape)) or "scalar", _size(t.nbytes))
        for t in inspection.tensors
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    lines.append("")
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    total = sum(t.nbytes for t in inspection.tensors)
    lines.append(
        f"{len(rows)} tensors, {sum(_numel(t.shape) for t in inspection.tensors):,} elements, {_size(total)}"
    )
    if inspection.other:
        lines.append(
            f"{len(inspection.other)} other entries: "
            + ", ".join(inspection.other[:8])
            + (" ..." if len(inspection.other) > 8 else "")
        )
    return "\n".join(lines)
