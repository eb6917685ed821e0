"""The README's pipeline over a plain nn.Sequential, on 2 ranks, against the unsplit model."""

import torch
import torch.distributed as dist
from torch import nn

from d9d.mesh.testing import run_distributed
from d9d.pipeline import (
    ActionCosts,
    OneFOneBScheduleConfig,
    PipelineExecutor,
    build_1f1b_program,
    build_program,
    layers_of_stage,
    simulate_program,
    stages_for_rank,
)


def _readme() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = OneFOneBScheduleConfig()
    program = build_program(config, num_ranks=world, num_microbatches=4)

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
    stages = {}
    for info in stages_for_rank(config, num_ranks=world, rank=rank):
        stages[info.current_stage] = nn.Sequential(*(layers[i] for i in layers_of_stage(info, len(layers))))

    executor = PipelineExecutor(program, stages)
    batch, target = torch.randn(8, 16), torch.randn(8, 16)
    targets = target.chunk(program.num_microbatches)
    losses = executor.step(batch, loss_fn=lambda out, m: ((out - targets[m]) ** 2).mean() / 4)
    outputs = executor.forward(batch)

    torch.manual_seed(0)
    reference = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
    ref_out = reference(batch)
    ref_loss = ((ref_out - target) ** 2).mean()
    ref_loss.backward()
    worst = 0.0
    for i in [
        i for info in stages_for_rank(config, num_ranks=world, rank=rank) for i in layers_of_stage(info, 4)
    ]:
        for p, q in zip(layers[i].parameters(), reference[i].parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    if executor.has_last_stage:
        assert losses is not None and outputs is not None
        torch.testing.assert_close(sum(losses), ref_loss.detach())
        torch.testing.assert_close(torch.cat(outputs), ref_out.detach())
    return worst


def test_readme_sequential_pipeline() -> None:
    assert max(run_distributed(_readme, world_size=2, timeout_s=120)) < 1e-6


def test_readme_timeline() -> None:
    program = build_1f1b_program(num_ranks=4, num_microbatches=8)
    assert program.format().splitlines()[1].startswith("rank 0: F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1")
    text = simulate_program(program, ActionCosts(forward=1, backward=2)).draw_text()
    assert text.splitlines()[0] == "r0 |F0F1F2F3............B0--F4B1--F5B2--F6B3--F7B4--..B5--..B6--..B7--|"
    assert text.splitlines()[-1] == "bubble 0.273, makespan 33, peak live activations [4, 3, 2, 1]"
