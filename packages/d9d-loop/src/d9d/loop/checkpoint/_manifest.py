"""A checkpoint's manifest: every file's size and CRC-32, and the run layout it was written by.

The manifest is written last into the ``.partial`` directory, before the atomic rename, so a
complete checkpoint always has one. Resume compares the files against it before loading.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

MANIFEST_FILE = "d9d_manifest.json"
_FORMAT = 1
_CHUNK = 16 << 20

VerifyMode = Literal["sizes", "checksums"]
_T = TypeVar("_T")


@dataclass(kw_only=True, frozen=True)
class RunLayout:
    """What a checkpoint must agree on with the run resuming from it.

    Attributes:
        global_batch_size: Samples per optimizer step when the checkpoint was written.
        optimizer: Class name of the optimizer whose state the checkpoint holds.
    """

    global_batch_size: int
    optimizer: str


@dataclass(kw_only=True, frozen=True)
class FileRecord:
    """One file of a checkpoint: its path relative to the checkpoint, size and CRC-32."""

    name: str
    size: int
    crc32: int


@dataclass(kw_only=True, frozen=True)
class Manifest:
    """The contents of ``d9d_manifest.json``."""

    step: int
    layout: RunLayout
    files: tuple[FileRecord, ...]


class ManifestError(ValueError):
    """A manifest is missing a field or is not valid JSON; names the file."""


def list_files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` (relative, sorted), the manifest excluded."""
    names = [
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if path.is_file() and path.name != MANIFEST_FILE
    ]
    return sorted(names)


def share(items: Sequence[_T], rank: int, world_size: int) -> list[_T]:
    """This rank's share of ``items`` (round robin), so ranks read files in parallel."""
    return list(items[rank::world_size])


def crc32_of(path: Path) -> int:
    """CRC-32 of a file, read in 16 MiB chunks."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def record_files(directory: Path, names: Sequence[str]) -> list[FileRecord]:
    """Size and CRC-32 of each named file."""
    return [
        FileRecord(name=name, size=(directory / name).stat().st_size, crc32=crc32_of(directory / name))
        for name in names
    ]


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Writes and fsyncs the manifest into ``directory``."""
    payload: dict[str, Any] = {
        "format": _FORMAT,
        "step": manifest.step,
        "layout": asdict(manifest.layout),
        "files": [asdict(f) for f in sorted(manifest.files, key=lambda f: f.name)],
    }
    with (directory / MANIFEST_FILE).open("w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of a checkpoint; None for a checkpoint written before manifests existed.

    Raises:
        ManifestError: If the manifest exists but cannot be parsed, naming it.
    """
    path = directory / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        raw: Any = json.loads(path.read_text())
        layout = RunLayout(
            global_batch_size=int(raw["layout"]["global_batch_size"]),
            optimizer=str(raw["layout"]["optimizer"]),
        )
        files = tuple(
            FileRecord(name=str(f["name"]), size=int(f["size"]), crc32=int(f["crc32"])) for f in raw["files"]
        )
        return Manifest(step=int(raw["step"]), layout=layout, files=files)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{path} is unreadable: {type(e).__name__}: {e}") from e


def check_files(directory: Path, records: Sequence[FileRecord], mode: VerifyMode) -> list[str]:
    """Problems of the given files against their records (empty when all are intact).

    Each problem names the file: missing, a size other than recorded, or (``checksums``) a
    CRC-32 other than recorded.
    """
    problems: list[str] = []
    for record in records:
        path = directory / record.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        if size != record.size:
            problems.append(f"{path} has {size} bytes, the manifest says {record.size}")
            continue
        match mode:
            case "sizes":
                pass
            case "checksums":
                crc = crc32_of(path)
                if crc != record.crc32:
                    problems.append(f"{path} has CRC-32 {crc:08x}, the manifest says {record.crc32:08x}")
    return problems
