"""A DCP checkpoint checked before ``d9d inspect`` lists it or ``d9d export`` loads it.

Its files against the manifest the trainer wrote (sizes and CRC-32: the check resume runs with
``trainer.checkpoint.verify: checksums``), each file against the byte ranges ``.metadata`` places
in it (a checkpoint without a manifest is checked for truncation too), and its model tensors
against the model that loads them: every tensor of the model present with its shape, and every
model tensor of the checkpoint used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from d9d.loop.checkpoint._manifest import Manifest, ManifestError, check_files, read_manifest
from d9d.loop.checkpoint._shapes import shape_mismatches
from d9d.loop.cli._errors import CommandError

_LISTED = 3


def listing(items: Sequence[str]) -> str:
    """The first few items and how many more, on one line."""
    more = f", ... ({len(items) - _LISTED} more)" if len(items) > _LISTED else ""
    return "; ".join(items[:_LISTED]) + more


def _stored_where(metadata: Metadata) -> dict[str, list[tuple[str, int]]]:
    """Each file's stored items: their DCP key and the end of their bytes in the file."""
    by_file: dict[str, list[tuple[str, int]]] = {}
    storage = cast(Mapping[Any, Any], metadata.storage_data or {})
    for index, info in storage.items():
        by_file.setdefault(str(info.relative_path), []).append(
            (str(index.fqn), int(info.offset) + int(info.length))
        )
    return by_file


def read_checkpoint_metadata(path: Path) -> Metadata:
    """The checkpoint's ``.metadata`` (a pickle: a checkpoint is trusted input).

    Raises:
        CommandError: If it cannot be read, naming it.
    """
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # torch raises several kinds on a broken .metadata
        raise CommandError(f"{path}/.metadata cannot be read: {type(e).__name__}: {e}") from e


def verify_checkpoint(path: Path, metadata: Metadata) -> Manifest | None:
    """Checks the files of the checkpoint at ``path``; returns its manifest (None: none written).

    Raises:
        CommandError: If the manifest is unreadable, or a file is missing, truncated or differs
            from its manifest record; names the files and the tensors stored in them.
    """
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        raise CommandError(str(e)) from e
    problems = [] if manifest is None else check_files(path, manifest.files, "checksums")
    stored = _stored_where(metadata)
    damaged_tensors: list[str] = []
    for name, items in sorted(stored.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if any(p.startswith(f"{file} ") for p in problems):
            damaged_tensors += [key for key, _ in items]
        elif size is None:
            problems.append(f"{file} is missing")
            damaged_tensors += [key for key, _ in items]
        elif size < max(end for _, end in items):
            problems.append(f"{file} has {size} bytes, .metadata places {max(end for _, end in items)}")
            damaged_tensors += [key for key, end in items if end > size]
    if problems:
        holding = f"; they hold {listing(sorted(set(damaged_tensors)))}" if damaged_tensors else ""
        raise CommandError(f"{path} is damaged: {listing(problems)}{holding}")
    return manifest


def check_model_fit(
    path: Path,
    saved: Mapping[str, object],
    wanted: Mapping[str, tuple[int, ...]],
    *,
    section: str,
    model: str,
) -> None:
    """Checks that the checkpoint's ``section`` tensors and the model's are the same set, same shapes.

    Args:
        path: The checkpoint (named in the error).
        saved: Its ``state_dict_metadata``.
        wanted: The model's tensors by DCP key (``tensor_shapes``), all under ``section``.
        section: The top-level key holding the model (``model``).
        model: What the model was built from (named in the error).

    Raises:
        CommandError: If a tensor of the model is missing or of another shape, or a tensor of
            the checkpoint's ``section`` is not the model's; names the first few and the counts.
    """
    mismatched = shape_mismatches(saved, wanted)
    unused = sorted(key for key in saved if key.split(".", 1)[0] == section and key not in wanted)
    if not mismatched and not unused:
        return
    parts: list[str] = []
    if mismatched:
        parts.append(f"{len(mismatched)} tensors of the model do not fit: {listing(mismatched)}")
    if unused:
        parts.append(f"{len(unused)} tensors of the checkpoint are not the model's: {listing(unused)}")
    raise CommandError(f"{path} was not written by the model of {model}: " + "; ".join(parts))
