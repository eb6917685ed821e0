"""The Model Design guide's model (docs/model-design.md) trains the same on every layout.

The guide's runnable blocks are loaded as a module (its ``__main__`` check does not run here);
one process, FSDP over 2 ranks, a 2-stage pipeline and both combined on 4 ranks must give the
same loss at every step.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
from test_guides import DOCS, runnable_blocks

from d9d.mesh.testing import run_distributed

GUIDE = DOCS / "model-design.md"
_MODULE = "d9d_model_design_guide"


def load_guide() -> types.ModuleType:
    """The guide's code as an importable module (registered first: dataclasses and pickling by
    reference look it up by name, also in the ranks forked from the test zygote)."""
    loaded = sys.modules.get(_MODULE)
    if loaded is not None:
        return loaded
    module = types.ModuleType(_MODULE)
    module.__file__ = str(GUIDE)
    sys.modules[_MODULE] = module
    code = compile("\n\n".join(runnable_blocks(GUIDE.read_text())), str(GUIDE), "exec")
    exec(code, module.__dict__)  # runs the guide's own checks too (the block against its recurrence)
    return module


guide: Any = load_guide()  # at collection, before the zygote is forked


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model_design") / "config.yaml"
    path.write_text(guide.CONFIG_YAML)
    return str(path)


@pytest.fixture(scope="module")
def single_process_losses(config_path: str) -> list[float]:
    losses: list[float] = run_distributed(guide.train, config_path, {}, world_size=1)[0]
    assert len(losses) == 6
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses


@pytest.mark.parametrize(
    ("mesh", "world"),
    [
        ({"data_parallel_shard": 2}, 2),  # FSDP
        ({"pipeline_parallel": 2}, 2),  # 1F1B over two stages
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, 4),  # both
    ],
)
def test_the_guide_model_trains_like_one_process(
    config_path: str, single_process_losses: list[float], mesh: dict[str, int], world: int
) -> None:
    curves: list[list[float]] = run_distributed(
        guide.train, config_path, mesh, world_size=world, timeout_s=240
    )
    reference = torch.tensor(single_process_losses)
    for curve in curves:
        torch.testing.assert_close(torch.tensor(curve), reference, rtol=1e-4, atol=0)


def test_the_guide_block_parallel_form_has_the_recurrence_gradients() -> None:
    torch.manual_seed(1)
    block = guide.GatedRecurrence(hidden_size=8, num_heads=2, head_dim=4)
    block.reset_parameters()
    x = torch.randn(2, 7, 8, requires_grad=True)
    parallel = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    sequential = torch.autograd.grad(block.recurrent_forward(x).square().sum(), [x, *block.parameters()])
    for a, b in zip(parallel, sequential, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
