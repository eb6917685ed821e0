"""Whether an export may replace what is at its target: a previous export yes, a user's files no."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

EXPORT_MARKER = ".d9d-export"
"""A file every d9d export holds, so that a later export knows the directory is its own.

It lists the files the export wrote: a file added later (the user's notes, a README) is not
d9d's, and replacing the export would delete it.
"""

_LISTED = 5


class ExportTargetError(FileExistsError):
    """An export target holds files that are not a d9d export; the message says how to proceed."""


def write_export_marker(directory: Path) -> None:
    """Marks ``directory`` as a d9d export, listing every file in it (JSON that transformers ignores)."""
    written = _files(directory)
    payload = {"written_by": "d9d", "files": written}
    (directory / EXPORT_MARKER).write_text(json.dumps(payload, indent=1) + "\n")


def is_d9d_export(directory: Path) -> bool:
    """Whether ``directory`` is an export that d9d wrote (it holds the marker)."""
    return (directory / EXPORT_MARKER).is_file()


def _files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if not p.is_dir() and p.name != EXPORT_MARKER
    )


def foreign_files(directory: Path) -> list[str]:
    """Files under ``directory`` that no d9d export wrote (relative paths, sorted).

    Every file when ``directory`` is not a d9d export; in an export, the files its marker does
    not list (an export of an older d9d, whose marker lists none, counts as all d9d's).
    """
    files = _files(directory)
    if not is_d9d_export(directory):
        return files
    try:
        raw: object = json.loads((directory / EXPORT_MARKER).read_text())
        listed = cast(dict[str, object], raw).get("files") if isinstance(raw, dict) else None
    except (OSError, ValueError):
        return files  # an unreadable marker proves nothing
    if listed is None:
        return []  # written before markers listed files
    if not isinstance(listed, list):
        return files
    written = {str(name) for name in cast(list[object], listed)}
    return [name for name in files if name not in written]


def _describe(target: Path, foreign: list[str]) -> str:
    shown = ", ".join(foreign[:_LISTED])
    more = f" and {len(foreign) - _LISTED} more" if len(foreign) > _LISTED else ""
    kind = (
        "a d9d export holding files d9d did not write"
        if is_d9d_export(target)
        else f"a non-empty directory that is not a d9d export (no {EXPORT_MARKER} file)"
    )
    return f"export target {target} is {kind} ({shown}{more})"


def check_replaceable(target: Path | str) -> None:
    """Refuses to replace ``target`` unless everything in it was written by a d9d export.

    Raises:
        ExportTargetError: If ``target`` is a file, or holds files no d9d export wrote, naming
            the directory and those files; nothing was written or deleted.
    """
    target = Path(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise ExportTargetError(f"export target {target} is a file, not a directory; nothing was written")
    foreign = foreign_files(target)
    if foreign:
        raise ExportTargetError(
            f"{_describe(target, foreign)}; they would be lost, so nothing was written or deleted. "
            "Choose another export directory, move those files away, or pass replace_other=True"
        )


def check_export_target(target: Path | str, *, replace_other: bool = False) -> bool:
    """Decides, before any work, whether an export to ``target`` replaces what is there.

    Call it before training and pass the result as ``Trainer.export(..., overwrite=...)``.

    Args:
        target: The export directory.
        replace_other: Replace a non-empty directory holding files no d9d export wrote too (the
            user opted in to losing them).

    Returns:
        False when ``target`` is absent or empty (nothing to replace); True when it is a
        previous d9d export holding only what that export wrote, or ``replace_other`` is set.

    Raises:
        ExportTargetError: If ``target`` is a file, or a non-empty directory holding files no d9d
            export wrote (named) and ``replace_other`` is False; nothing was written or deleted.
    """
    target = Path(target)
    if not target.exists():
        return False
    if not target.is_dir():
        raise ExportTargetError(f"export target {target} is a file, not a directory; nothing was written")
    if not any(target.iterdir()):
        return False
    foreign = foreign_files(target)
    if not foreign or replace_other:
        return True
    raise ExportTargetError(
        f"{_describe(target, foreign)}; they would be lost, so nothing was trained or written. Choose "
        "another export directory, or opt in to replacing it"
    )
