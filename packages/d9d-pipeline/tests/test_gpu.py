"""The executors with stages on a CUDA device (skipped without one)."""

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d9d.pipeline import (
    DualPipeVScheduleConfig,
    LocalPipelineExecutor,
    OneFOneBScheduleConfig,
    PipelineExecutor,
    build_program,
)

from ._pipeline_model import build_stages, make_batch, make_loss_fn, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _to(tree: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tree.items()}


def test_local_executor_on_cuda_matches_cpu_reference() -> None:
    device = torch.device("cuda")
    program = build_program(DualPipeVScheduleConfig(), num_ranks=2, num_microbatches=4)
    stages = build_stages(program.num_stages, 8)
    inputs, shared, target = make_batch(16)
    ref_losses, ref_stages, _ = reference(stages, inputs, shared, target, 4)
    gpu_stages = [s.to(device) for s in stages]
    executor = LocalPipelineExecutor(program, dict(enumerate(gpu_stages)), device=device)
    losses = executor.step(
        _to(inputs, device), loss_fn=make_loss_fn(target.to(device), 4), shared=_to(shared, device)
    )
    torch.testing.assert_close(torch.stack(losses).cpu(), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    for stage, ref in zip(gpu_stages, ref_stages, strict=True):
        for p, q in zip(stage.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)


def test_overlapped_pairs_on_cuda_streams_match_serial_pairs() -> None:
    # DualPipeV's pairs run each stage on its own stream: wide layers and eight microbatches give
    # the streams time to race if a wait or a record_stream were missing.
    device = torch.device("cuda")
    results = []
    for overlap in (True, False):
        program = build_program(DualPipeVScheduleConfig(overlap=overlap), num_ranks=2, num_microbatches=8)
        torch.manual_seed(0)
        stages = [nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(3))).to(device) for _ in range(4)]
        executor = LocalPipelineExecutor(
            program, {s: _Wrapped(m) for s, m in enumerate(stages)}, device=device
        )
        gen = torch.Generator(device=device).manual_seed(1)
        batch = torch.randn(8 * 512, 1024, device=device, generator=gen)
        losses = executor.step({"h": batch}, loss_fn=lambda out, m: out["h"].pow(2).mean() * (m + 1))
        results.append((torch.stack(losses), [p.grad.clone() for m in stages for p in m.parameters()]))
    (on_losses, on_grads), (off_losses, off_grads) = results
    torch.testing.assert_close(on_losses, off_losses)
    for got, want in zip(on_grads, off_grads, strict=True):
        torch.testing.assert_close(got, want)


class _Wrapped(nn.Module):
    def __init__(self, body: nn.Sequential) -> None:
        super().__init__()
        self.body = body
        self._point: Any = None

    def set_overlap_point(self, point: Any) -> None:
        self._point = point

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = inputs["h"]
        for layer in self.body:
            h = torch.tanh(layer(h))
            if self._point is not None:
                self._point(h)
        return {"h": h}


def test_executor_over_nccl_world_of_one() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        try:
            program = build_program(OneFOneBScheduleConfig(), num_ranks=1, num_microbatches=2)
            (stage,) = build_stages(1, 4)
            inputs, shared, target = make_batch(8)
            ref_losses, _, _ = reference([stage], inputs, shared, target, 2)
            executor = PipelineExecutor(program, {0: stage.to(device)})
            losses = executor.step(
                _to(inputs, device), loss_fn=make_loss_fn(target.to(device), 2), shared=_to(shared, device)
            )
            assert losses is not None
            torch.testing.assert_close(
                torch.stack(losses).cpu(), torch.stack(ref_losses), rtol=1e-4, atol=1e-5
            )
        finally:
            dist.destroy_process_group()
