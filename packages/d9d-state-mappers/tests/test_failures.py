"""Failures in the middle of a conversion or a distributed save leave nothing at the target."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from d9d.mesh.testing import DistributedTestError, run_distributed
from d9d.state_mappers import (
    Box,
    GroupPlan,
    MapperGroup,
    ParallelMapper,
    RenameMapper,
    TensorPiece,
    TensorSpec,
    convert_checkpoint,
    save_module_state,
)


class _FailingGroup(MapperGroup):
    """Renames a tensor, but raises when run on ``fail_rank`` (any rank when None)."""

    def __init__(self, source: str, target: str, fail_rank: int | None = None) -> None:
        self._source, self._target, self._fail_rank = source, target, fail_rank

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset((self._source,))

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset((self._target,))

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        return {self._target: input_specs[self._source]}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        box = output_boxes[self._target]

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            rank = dist.get_rank() if dist.is_initialized() else 0
            if self._fail_rank is None or rank == self._fail_rank:
                raise ValueError(f"mapping {self._source!r} failed on rank {rank}")
            return {self._target: pieces[self._source].narrow(box)}

        return GroupPlan(input_boxes={self._source: box}, run=run)


def test_group_failure_mid_conversion_removes_partial_files(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.full((256, 256), float(i)) for i in range(6)}
    save_file(tensors, tmp_path / "src.safetensors")
    # t0..t4 are written (to several small files) before t5's group fails.
    mapper = ParallelMapper([*(RenameMapper(f"t{i}", f"o{i}") for i in range(5)), _FailingGroup("t5", "o5")])
    with pytest.raises(ValueError, match="mapping 't5' failed on rank 0"):
        convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out", mapper, max_shard_size_bytes=2**18)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def _save_failing_on_rank_1(target: Path) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    mapper = ParallelMapper(
        [_FailingGroup("weight", "w", fail_rank=1), _FailingGroup("bias", "b", fail_rank=1)]
    )
    save_module_state(target, module, mapper, process_group=dist.group.WORLD)


def test_failure_on_one_rank_of_a_distributed_save_fails_every_rank(tmp_path: Path) -> None:
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_save_failing_on_rank_1, tmp_path / "out", world_size=2, timeout_s=180)
    text = str(error.value)
    # Both ranks raise (no hang), each naming rank 1's failure; nothing reaches the target.
    assert "2 of 2 ranks failed" in text
    assert (
        text.count("mapping 'weight' failed on rank 1") + text.count("mapping 'bias' failed on rank 1") >= 2
    )
    assert list(tmp_path.iterdir()) == []
