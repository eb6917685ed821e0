"""Bad input to convert_checkpoint: a clear error naming the key or file, and nothing at the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from d9d.state_mappers import CheckpointFormatError, StateMappingError, convert_checkpoint


def _break(source: Path, case: str, hf: dict[str, torch.Tensor], layouts) -> None:
    match case:
        case "missing-key":
            del hf["model.layers.1.mlp.experts.2.up_proj.weight"]
        case "unexpected-key":
            hf["model.rotary.inv_freq"] = torch.ones(4)
        case "shape-mismatch":
            hf["model.layers.0.mlp.experts.3.gate_proj.weight"] = torch.zeros(5, 8)
    layouts.write_sharded(hf, source, 3, index=True)
    match case:
        case "truncated-file":
            file = source / "part-1.safetensors"
            file.write_bytes(file.read_bytes()[:-100])
        case "corrupt-header":
            file = source / "part-2.safetensors"
            raw = bytearray(file.read_bytes())
            raw[8:12] = b"\xff\xfe\x00{"
            file.write_bytes(bytes(raw))
        case "index-names-absent-file":
            (source / "part-0.safetensors").unlink()


@pytest.mark.parametrize(
    ("case", "error", "fragments"),
    [
        # the mapper needs a tensor the checkpoint lacks
        (
            "missing-key",
            StateMappingError,
            ["missing from the source", "model.layers.1.mlp.experts.2.up_proj.weight"],
        ),
        # the checkpoint holds a tensor nothing consumes
        ("unexpected-key", StateMappingError, ["unexpected in the source", "model.rotary.inv_freq"]),
        # a per-expert weight of the wrong shape cannot be concatenated/stacked with the others
        (
            "shape-mismatch",
            StateMappingError,
            ["does not fit its inputs", "model.layers.0.mlp.experts.3.gate_proj.weight"],
        ),
        # a file cut short
        ("truncated-file", CheckpointFormatError, ["part-1.safetensors", "truncated"]),
        # a header that is not valid JSON
        ("corrupt-header", CheckpointFormatError, ["part-2.safetensors", "corrupt header"]),
        # the index names a file that is not there
        (
            "index-names-absent-file",
            CheckpointFormatError,
            ["names files that do not exist", "part-0.safetensors"],
        ),
    ],
)
def test_bad_input_is_named_and_nothing_is_written(
    layouts, tmp_path: Path, case: str, error, fragments
) -> None:
    hf = layouts.hf_state(seed=11)
    source = tmp_path / "src"
    _break(source, case, hf, layouts)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error) as raised:
        convert_checkpoint(source, tmp_path / "out", layouts.hf_to_fused_mapper())
    for fragment in fragments:
        assert fragment in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
