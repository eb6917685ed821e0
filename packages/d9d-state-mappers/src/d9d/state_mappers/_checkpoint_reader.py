"""Reading safetensors checkpoints tensor by tensor, slice by slice, without memory-mapping."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from d9d.state_mappers._errors import CheckpointFormatError
from d9d.state_mappers._safetensors_format import StoredTensor, read_header
from d9d.state_mappers._spec import Box, TensorSpec, box_shape, full_box

INDEX_FILE = "model.safetensors.index.json"


def _check_inside(index: Path, name: str, file: str) -> None:
    """Refuses an index entry whose file is not a plain name inside the checkpoint's directory.

    The check is on the written path (absolute, a drive, or a ``..`` part), not on where it
    resolves: a Hub cache's snapshot files are symlinks into its blob store, and are fine.

    Raises:
        CheckpointFormatError: Naming the index and the entry.
    """
    relative = PurePosixPath(file.replace("\\", "/"))
    if relative.is_absolute() or ".." in relative.parts or ":" in file or not relative.parts:
        raise CheckpointFormatError(
            f"{index}: weight_map entry {name!r} -> {file!r} points outside {index.parent}; "
            "an index names files inside its own directory"
        )


class SafetensorsCheckpoint:
    """A safetensors checkpoint opened for streaming: a directory (with or without an index) or a file.

    Opening reads and checks every header (and the index), so a missing file, a truncated file
    or a corrupt header is reported before any tensor data is read. Tensors are then read with
    plain file reads into fresh buffers: memory holds only what the caller keeps, and a slice
    reads only the bytes of that slice.

    Attributes:
        bytes_read: Tensor bytes read so far (for measuring how much a sharded load reads).
    """

    def __init__(self, path: Path | str) -> None:
        self._path = Path(path)
        self._entries: dict[str, tuple[Path, StoredTensor]] = {}
        self._files: list[Path] = []
        self.bytes_read = 0
        if self._path.is_file():
            self._add_file(self._path, None)
        elif self._path.is_dir():
            index = self._path / INDEX_FILE
            if index.exists():
                self._open_indexed(index)
            else:
                files = sorted(self._path.glob("*.safetensors"))
                if not files:
                    raise CheckpointFormatError(f"{self._path}: no *.safetensors files and no {INDEX_FILE}")
                for file in files:
                    self._add_file(file, None)
        else:
            raise CheckpointFormatError(f"{self._path}: no such file or directory")

    def _open_indexed(self, index: Path) -> None:
        try:
            content: Any = json.loads(index.read_text())
            weight_map: dict[str, str] = {str(k): str(v) for k, v in content["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
            raise CheckpointFormatError(f"{index}: not a valid safetensors index: {error}") from error
        by_file: dict[str, set[str]] = {}
        for name, file in weight_map.items():
            _check_inside(index, name, file)
            by_file.setdefault(file, set()).add(name)
        absent = sorted(f for f in by_file if not (self._path / f).is_file())
        if absent:
            raise CheckpointFormatError(f"{index}: names files that do not exist: {absent}")
        for file in sorted(by_file):
            self._add_file(self._path / file, by_file[file])

    def _add_file(self, file: Path, names: set[str] | None) -> None:
        header = read_header(file)
        if names is not None:
            absent = sorted(names - set(header))
            if absent:
                raise CheckpointFormatError(
                    f"{file}: the index places tensors here that the file does not hold: {absent[:20]}"
                )
        self._files.append(file)
        for name, stored in header.items():
            if names is not None and name not in names:
                continue
            if name in self._entries:
                raise CheckpointFormatError(
                    f"tensor {name!r} is stored twice: in {self._entries[name][0]} and in {file}"
                )
            self._entries[name] = (file, stored)

    @property
    def path(self) -> Path:
        """The directory or file this checkpoint was opened from."""
        return self._path

    @property
    def files(self) -> list[Path]:
        """The safetensors files, in reading order."""
        return list(self._files)

    @property
    def specs(self) -> dict[str, TensorSpec]:
        """Spec of every tensor."""
        return {name: stored.spec for name, (_, stored) in self._entries.items()}

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``."""
        return self._entries[name][0]

    def names_in(self, file: Path) -> list[str]:
        """Names of the tensors in ``file``, in order of their position in it."""
        names = [n for n, (f, _) in self._entries.items() if f == file]
        return sorted(names, key=lambda n: self._entries[n][1].offset)

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """Reads tensor ``name``, or only its slice ``box``, into a new CPU tensor.

        A slice is read as the fewest contiguous byte runs: a slice along the first tensor dim
        (as FSDP shards) is a single read.

        Raises:
            CheckpointFormatError: If the file ends early.
        """
        file, stored = self._entries[name]
        spec = stored.spec
        box = full_box(spec.shape) if box is None else box
        shape = box_shape(box)
        item = spec.dtype.itemsize
        buffer = torch.empty(math.prod(shape) * item, dtype=torch.uint8)
        if buffer.numel() > 0:
            view = buffer.numpy().data
            strides = [math.prod(spec.shape[d + 1 :]) for d in range(len(spec.shape))]
            # The innermost dims that the box covers whole, plus one more, form contiguous runs.
            split = len(box)
            while split > 0 and box[split - 1] == (0, spec.shape[split - 1]):
                split -= 1
            run_dim = max(split - 1, 0)
            run_elems = math.prod(shape[run_dim:]) if box else 1
            with file.open("rb", buffering=0) as f:
                written = 0
                for index in itertools.product(*(range(s, e) for s, e in box[:run_dim])):
                    element = sum(i * st for i, st in zip(index, strides, strict=False))
                    if box:
                        element += box[run_dim][0] * strides[run_dim]
                    nbytes = run_elems * item
                    self._read_into(
                        f, file, name, stored.offset + element * item, view[written : written + nbytes]
                    )
                    written += nbytes
        self.bytes_read += buffer.numel()
        return buffer.view(spec.dtype).reshape(shape)

    @staticmethod
    def _read_into(f: Any, file: Path, name: str, offset: int, view: memoryview) -> None:
        f.seek(offset)
        done = 0
        while done < len(view):
            count = f.readinto(view[done:])
            if not count:
                raise CheckpointFormatError(f"{file}: ends inside tensor {name!r} (truncated while reading)")
            done += count
