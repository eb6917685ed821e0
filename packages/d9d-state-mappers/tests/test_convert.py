"""convert_checkpoint: bit-exact round trips, sharding, atomic writes, HF-compatible output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from d9d.state_mappers import (
    CheckpointFormatError,
    ParallelMapper,
    RenameMapper,
    SafetensorsCheckpoint,
    StateMappingError,
    convert_checkpoint,
    identity_mapper_from_module,
)


def _load_dir(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / file))
    assert set(out) == set(index["weight_map"])
    return out


def _assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize(
    ("files", "index", "dtype"),
    [
        (1, False, torch.float32),  # one file, no index
        (3, True, torch.bfloat16),  # several files with an index; bf16 bits survive
        (4, False, torch.float16),  # several files found by globbing
    ],
)
def test_hf_to_fused_and_back_is_bit_exact(
    layouts, tmp_path: Path, files: int, index: bool, dtype: torch.dtype
) -> None:
    hf = layouts.hf_state(seed=1, dtype=dtype)
    layouts.write_sharded(hf, tmp_path / "hf", files, index=index)
    convert_checkpoint(tmp_path / "hf", tmp_path / "fused", layouts.hf_to_fused_mapper(), show_progress=False)
    _assert_bit_exact(_load_dir(tmp_path / "fused"), layouts.fused_reference(hf))
    convert_checkpoint(
        tmp_path / "fused", tmp_path / "back", layouts.fused_to_hf_mapper(), show_progress=False
    )
    _assert_bit_exact(_load_dir(tmp_path / "back"), hf)


def test_single_file_source(layouts, tmp_path: Path) -> None:
    hf = layouts.hf_state(seed=2)
    save_file(hf, tmp_path / "model.safetensors")
    convert_checkpoint(tmp_path / "model.safetensors", tmp_path / "fused", layouts.hf_to_fused_mapper())
    _assert_bit_exact(_load_dir(tmp_path / "fused"), layouts.fused_reference(hf))


def test_max_shard_size_splits_files_and_index_is_hf_style(layouts, tmp_path: Path) -> None:
    hf = layouts.hf_state(seed=3)
    layouts.write_sharded(hf, tmp_path / "hf", 2, index=True)
    limit = 2048
    convert_checkpoint(
        tmp_path / "hf", tmp_path / "out", layouts.hf_to_fused_mapper(), max_shard_size_bytes=limit
    )
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [*files, "model.safetensors.index.json"]
    )
    fused = layouts.fused_reference(hf)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in fused.values())
    for file in files:
        tensors = load_file(tmp_path / "out" / file)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        # A file exceeds the limit only when it holds one tensor larger than the limit.
        assert size <= limit or len(tensors) == 1
    _assert_bit_exact(_load_dir(tmp_path / "out"), fused)


def test_converted_checkpoint_reads_back_through_streaming_reader(layouts, tmp_path: Path) -> None:
    hf = layouts.hf_state(seed=4)
    layouts.write_sharded(hf, tmp_path / "hf", 2, index=False)
    model = layouts.fused_model()
    convert_checkpoint(
        tmp_path / "hf", tmp_path / "fused", layouts.hf_to_fused_mapper(), max_shard_size_bytes=4096
    )
    checkpoint = SafetensorsCheckpoint(tmp_path / "fused")
    assert set(checkpoint.specs) == set(model.state_dict())
    fused = layouts.fused_reference(hf)
    for name, tensor in fused.items():
        assert torch.equal(checkpoint.read(name), tensor), name
    # The identity graph of a module with the fused layout converts the fused checkpoint as is.
    convert_checkpoint(tmp_path / "fused", tmp_path / "copy", identity_mapper_from_module(model))
    _assert_bit_exact(_load_dir(tmp_path / "copy"), fused)


def test_existing_target_is_refused_unless_overwrite(tmp_path: Path) -> None:
    save_file({"a": torch.arange(4.0)}, tmp_path / "src.safetensors")
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="out"):
        convert_checkpoint(tmp_path / "src.safetensors", target, RenameMapper("a", "b"))
    assert (target / "keep.txt").read_text() == "old"
    convert_checkpoint(tmp_path / "src.safetensors", target, RenameMapper("a", "b"), overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert torch.equal(_load_dir(target)["b"], torch.arange(4.0))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_failure_while_streaming_leaves_nothing_at_target(tmp_path: Path) -> None:
    source = tmp_path / "src.safetensors"
    save_file({"a": torch.arange(4.0), "b": torch.arange(3.0)}, source)
    raw = source.read_bytes()
    checkpoint = SafetensorsCheckpoint(source)
    # The file is cut after its header was checked: the failure surfaces while streaming.
    source.write_bytes(raw[:-4])
    mapper = ParallelMapper([RenameMapper("a", "x"), RenameMapper("b", "y")])
    with pytest.raises(CheckpointFormatError, match="truncated while reading"):
        convert_checkpoint(checkpoint, tmp_path / "out", mapper)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src.safetensors"]


def test_mapping_error_is_raised_before_anything_is_written(layouts, tmp_path: Path) -> None:
    hf = layouts.hf_state(seed=5)
    layouts.write_sharded(hf, tmp_path / "hf", 1, index=False)
    with pytest.raises(StateMappingError, match=r"lm_head\.weight"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "out", RenameMapper("model.norm.weight", "norm"))
    assert not (tmp_path / "out").exists()
