"""The streaming reader: layouts, slices, bad files, and the order in which groups stream."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from d9d.state_mappers import (
    Box,
    CheckpointFormatError,
    GroupPlan,
    MapperGroup,
    ParallelMapper,
    RenameMapper,
    SafetensorsCheckpoint,
    TensorPiece,
    TensorSpec,
    convert_checkpoint,
)


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(5, 4, 3),
        "b": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(3, 2).to(torch.bfloat16),
        "flag": torch.tensor([True, False, True]),
        "s": torch.tensor(3.5),
    }


@pytest.mark.parametrize("layout", ["file", "dir", "dir-index"])
def test_reads_every_layout_exactly(tmp_path: Path, layout: str) -> None:
    tensors = _tensors()
    if layout == "file":
        save_file(tensors, tmp_path / "one.safetensors")
        path = tmp_path / "one.safetensors"
    else:
        save_file({k: tensors[k] for k in ("w", "b")}, tmp_path / "x-1.safetensors")
        save_file({k: tensors[k] for k in ("h", "flag", "s")}, tmp_path / "x-2.safetensors")
        if layout == "dir-index":
            weight_map = {"w": "x-1.safetensors", "b": "x-1.safetensors"}
            weight_map |= dict.fromkeys(("h", "flag", "s"), "x-2.safetensors")
            (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        path = tmp_path
    checkpoint = SafetensorsCheckpoint(path)
    assert checkpoint.specs == {n: TensorSpec.of(t) for n, t in tensors.items()}
    for name, tensor in tensors.items():
        assert torch.equal(checkpoint.read(name), tensor), name
    assert checkpoint.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize(
    "box",
    [
        ((1, 3), (0, 4), (0, 3)),  # rows: one contiguous read
        ((0, 5), (1, 3), (0, 3)),  # middle dim
        ((2, 4), (1, 2), (1, 3)),  # every dim cut
        ((3, 3), (0, 4), (0, 3)),  # empty
    ],
)
def test_slice_reads_only_the_slice(tmp_path: Path, box: Box) -> None:
    w = torch.randn(5, 4, 3)
    save_file({"w": w}, tmp_path / "w.safetensors")
    checkpoint = SafetensorsCheckpoint(tmp_path / "w.safetensors")
    got = checkpoint.read("w", box)
    want = w[box[0][0] : box[0][1], box[1][0] : box[1][1], box[2][0] : box[2][1]]
    assert torch.equal(got, want)
    assert checkpoint.bytes_read == want.numel() * 4


def _write_raw(path: Path, header: dict[str, object], data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        # data cut short: the header promises more bytes than the file holds
        ("truncated-data", "truncated: tensor 'a' ends at data byte 16"),
        # file cut inside the header
        ("truncated-header", "header length"),
        # shorter than the length prefix
        ("tiny", "no safetensors header"),
        # header is not JSON
        ("garbage", "corrupt header"),
        # an entry whose byte range does not match its shape
        ("bad-entry", "tensor 'a': shape [4] of F32 does not match byte range"),
        # an unknown dtype
        ("bad-dtype", "unsupported dtype 'Q7'"),
    ],
)
def test_bad_files_are_reported_naming_the_file(tmp_path: Path, setup: str, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    good = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    match setup:
        case "truncated-data":
            _write_raw(path, good, b"\0" * 10)
        case "truncated-header":
            save_file({"a": torch.zeros(4)}, path)
            path.write_bytes(path.read_bytes()[:20])
        case "tiny":
            path.write_bytes(b"\1\2")
        case "garbage":
            path.write_bytes(struct.pack("<Q", 4) + b"{{{{" + b"\0" * 8)
        case "bad-entry":
            _write_raw(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16)
        case "bad-dtype":
            _write_raw(path, {"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16)
        case _:
            raise AssertionError(setup)
    with pytest.raises(CheckpointFormatError) as error:
        SafetensorsCheckpoint(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_index_naming_an_absent_file_is_reported_and_nothing_is_written(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    save_file({"a": torch.zeros(2)}, source / "one.safetensors")
    weight_map = {"a": "one.safetensors", "b": "two.safetensors"}
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    mapper = ParallelMapper([RenameMapper("a", "x"), RenameMapper("b", "y")])
    with pytest.raises(CheckpointFormatError, match=r"names files that do not exist: \['two.safetensors'\]"):
        convert_checkpoint(source, tmp_path / "out", mapper)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (
            "index-wrong-file",
            "the index places tensors here that the file does not hold: ['b']",
        ),  # index disagrees
        ("duplicate", "tensor 'a' is stored twice"),  # one name in two files
        ("empty", "no *.safetensors files"),  # nothing to read
        ("bad-index", "not a valid safetensors index"),  # index without weight_map
    ],
)
def test_bad_directories_are_reported(tmp_path: Path, setup: str, message: str) -> None:
    match setup:
        case "index-wrong-file":
            save_file({"a": torch.zeros(1)}, tmp_path / "one.safetensors")
            index = {"weight_map": {"a": "one.safetensors", "b": "one.safetensors"}}
            (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        case "duplicate":
            save_file({"a": torch.zeros(1)}, tmp_path / "one.safetensors")
            save_file({"a": torch.zeros(1)}, tmp_path / "two.safetensors")
        case "empty":
            pass
        case "bad-index":
            (tmp_path / "model.safetensors.index.json").write_text("{}")
        case _:
            raise AssertionError(setup)
    with pytest.raises(CheckpointFormatError) as error:
        SafetensorsCheckpoint(tmp_path)
    assert message in str(error.value)


class _Recorder(MapperGroup):
    """A user-defined group: sums its inputs and records how much had been read when it ran."""

    def __init__(
        self,
        inputs: list[str],
        output: str,
        log: list[tuple[str, int]],
        checkpoint: list[SafetensorsCheckpoint],
    ) -> None:
        self._inputs, self._output, self._log, self._checkpoint = inputs, output, log, checkpoint

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset(self._inputs)

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset((self._output,))

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return {self._output: input_specs[self._inputs[0]]}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        box = output_boxes[self._output]

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            self._log.append((self._output, self._checkpoint[0].bytes_read))
            return {self._output: torch.stack([pieces[n].narrow(box) for n in self._inputs]).sum(0)}

        return GroupPlan(input_boxes=dict.fromkeys(self._inputs, box), run=run)


def test_groups_run_as_soon_as_their_inputs_are_read(tmp_path: Path) -> None:
    # file 1 holds a0, a1, c0; file 2 holds b0, b1, c1. Group "a" completes inside file 1,
    # group "b" inside file 2, group "c" spans both and is held until c1 arrives.
    one = {"a0": torch.ones(4), "a1": torch.ones(4), "c0": torch.ones(4)}
    two = {"b0": torch.ones(4), "b1": torch.ones(4), "c1": torch.ones(4)}
    save_file(one, tmp_path / "1.safetensors")
    save_file(two, tmp_path / "2.safetensors")
    checkpoint = SafetensorsCheckpoint(tmp_path)
    log: list[tuple[str, int]] = []
    holder = [checkpoint]
    mapper = ParallelMapper(
        [
            _Recorder(["c0", "c1"], "c", log, holder),
            _Recorder(["a0", "a1"], "a", log, holder),
            _Recorder(["b0", "b1"], "b", log, holder),
        ]
    )
    convert_checkpoint(checkpoint, tmp_path / "out", mapper)
    # Within a file, tensors are read in the order of the first group needing them
    # (c0, a0, a1 | c1, b0, b1): "a" runs within file 1, "c" is held until c1 arrives in file 2.
    # Reads run ahead on a thread, so bytes_read is at least (not exactly) what each run needed.
    assert [name for name, _ in log] == ["a", "c", "b"]
    assert [read >= need for (_, read), need in zip(log, [48, 64, 96], strict=True)] == [True] * 3


@pytest.mark.parametrize(
    "hostile", ["../outside.safetensors", "/etc/outside.safetensors", "sub/../../x.safetensors"]
)
def test_index_pointing_outside_its_directory_is_refused_naming_the_entry(
    tmp_path: Path, hostile: str
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    save_file({"a": torch.zeros(2)}, source / "one.safetensors")
    save_file({"b": torch.ones(2)}, tmp_path / "outside.safetensors")  # what "../" would reach
    weight_map = {"a": "one.safetensors", "b": hostile}
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointFormatError, match="weight_map entry 'b'") as error:
        SafetensorsCheckpoint(source)
    assert hostile in str(error.value) and "points outside" in str(error.value)


def test_index_naming_a_file_in_a_subfolder_is_read(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "shards").mkdir(parents=True)
    save_file({"a": torch.zeros(2)}, source / "shards" / "one.safetensors")
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "shards/one.safetensors"}})
    )
    assert list(SafetensorsCheckpoint(source).specs) == ["a"]
