"""Whether an export may replace what is at its target: a previous export yes, a user's files no."""

from __future__ import annotations

import json
from pathlib import Path

EXPORT_MARKER = ".d9d-export"
"""A file every d9d export holds, so that a later export knows the directory is its own."""


class ExportTargetError(FileExistsError):
    """An export target holds files that are not a d9d export; the message says how to proceed."""


def write_export_marker(directory: Path) -> None:
    """Marks ``directory`` as a d9d export (a small JSON file that transformers ignores)."""
    (directory / EXPORT_MARKER).write_text(json.dumps({"written_by": "d9d"}) + "\n")


def is_d9d_export(directory: Path) -> bool:
    """Whether ``directory`` is an export that d9d wrote (it holds the marker)."""
    return (directory / EXPORT_MARKER).is_file()


def check_export_target(target: Path | str, *, replace_other: bool = False) -> bool:
    """Decides, before any work, whether an export to ``target`` replaces what is there.

    Call it before training and pass the result as ``Trainer.export(..., overwrite=...)``.

    Args:
        target: The export directory.
        replace_other: Replace a non-empty directory that is not a d9d export too (the user
            opted in to losing its contents).

    Returns:
        False when ``target`` is absent or empty (nothing to replace); True when it is a
        previous d9d export, or another non-empty directory and ``replace_other`` is set.

    Raises:
        ExportTargetError: If ``target`` is a file, or a non-empty directory that is not a d9d
            export and ``replace_other`` is False; nothing was written or deleted.
    """
    target = Path(target)
    if not target.exists():
        return False
    if not target.is_dir():
        raise ExportTargetError(f"export target {target} is a file, not a directory; nothing was written")
    if not any(target.iterdir()):
        return False
    if is_d9d_export(target) or replace_other:
        return True
    raise ExportTargetError(
        f"export target {target} is a non-empty directory that is not a d9d export (no {EXPORT_MARKER} "
        "file); its contents would be lost, so nothing was trained or written. Choose another export "
        "directory, or opt in to replacing it"
    )
