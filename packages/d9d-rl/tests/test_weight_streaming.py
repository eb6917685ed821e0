"""Weights streamed from an FSDP-sharded trainer model equal its parameters, in bounded batches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rl_tiny_model import tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from d9d.rl import EmbeddedRolloutEngine, stream_weights
from d9d.state_mappers import PrefixMapper, identity_mapper_from_module


class _Recorder:
    """A receiver that forwards to an engine and records the size of every batch."""

    def __init__(self, engine: EmbeddedRolloutEngine) -> None:
        self.engine = engine
        self.batches: list[int] = []

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = list(weights)
        self.batches.append(sum(t.numel() * t.element_size() for _, t in weights))
        self.engine.update_weights(weights)


def _stream_under_fsdp(batch_bytes: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    trainer_model = tiny_model(seed=1)
    for layer in trainer_model.model.decoder_layers():
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer_model, mesh=mesh)
    optimizer = torch.optim.AdamW(trainer_model.parameters(), lr=0.05)
    recorder = _Recorder(EmbeddedRolloutEngine(tiny_model(seed=0)))
    mismatches: list[str] = []
    reports = []
    for update in range(2):
        torch.manual_seed(update)
        ids = torch.randint(0, 48, (2, 6))
        trainer_model.loss(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
        reports.append(stream_weights(trainer_model, recorder, batch_bytes=batch_bytes))
        for name, value in trainer_model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if not torch.equal(recorder.engine.model.state_dict()[name], full):
                mismatches.append(f"update {update}: {name}")
    largest_tensor = max(p.numel() * p.element_size() for p in tiny_model().parameters())
    total = sum(p.numel() * p.element_size() for p in tiny_model().parameters())
    return {
        "mismatches": mismatches,
        "batches": recorder.batches,
        "largest_tensor": largest_tensor,
        "total": total,
        "reports": reports,
        "sharded": all(isinstance(p, DTensor) for p in trainer_model.parameters()),
    }


def test_streamed_weights_equal_the_fsdp_trainers_after_every_update() -> None:
    from d9d.mesh.testing import run_distributed

    batch_bytes = 8 * 2**10
    results = run_distributed(_stream_under_fsdp, batch_bytes, world_size=4, timeout_s=120)
    for result in results:
        assert result["sharded"]
        assert result["mismatches"] == []
        # bounded: a batch closes as soon as it reaches batch_bytes, so it never exceeds that
        # plus the one tensor that crossed the line; far below the whole model
        assert max(result["batches"]) < batch_bytes + result["largest_tensor"]
        assert max(result["batches"]) < result["total"] / 2
        assert len(result["reports"]) == 2 and result["reports"][0].batches > 2


def test_a_mapper_renames_on_the_way() -> None:
    source = tiny_model(seed=1)
    received: dict[str, torch.Tensor] = {}

    class _Sink:
        def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            received.update(weights)

    report = stream_weights(
        source, _Sink(), mapper=PrefixMapper(identity_mapper_from_module(source), output_prefix="policy.")
    )
    assert set(received) == {f"policy.{name}" for name in source.state_dict()}
    assert report.batches == 1 and report.tensors == len(received)
    with pytest.raises(ValueError, match="batch_bytes=0"):
        stream_weights(source, _Sink(), batch_bytes=0)
