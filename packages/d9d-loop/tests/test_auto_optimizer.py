from typing import Any

import pytest
import torch
from pydantic import TypeAdapter
from torch import nn

from d9d.loop import AutoOptimizerProvider, OptimizerConfig, OptimizerProviderContext

ADAPTER: TypeAdapter[Any] = TypeAdapter(OptimizerConfig)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"name": "adamw", "lr": 0.1}, torch.optim.AdamW),
        ({"name": "adam", "betas": [0.8, 0.9]}, torch.optim.Adam),
        ({"name": "sgd", "momentum": 0.9, "nesterov": True}, torch.optim.SGD),
    ],
)
def test_builds_the_named_optimizer(raw: dict[str, Any], expected: type) -> None:
    model = nn.Linear(3, 2)
    context = OptimizerProviderContext(dist_context=_CpuContext(), model_stages=[model])  # type: ignore[arg-type]
    optimizer = AutoOptimizerProvider(ADAPTER.validate_python(raw)).build(context)
    assert type(optimizer) is expected
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}


def test_stochastic_adamw_comes_from_d9d_kernels() -> None:
    kernels = pytest.importorskip("d9d.kernels")
    model = nn.Linear(3, 2).to(torch.bfloat16)
    context = OptimizerProviderContext(dist_context=_CpuContext(), model_stages=[model])  # type: ignore[arg-type]
    optimizer = AutoOptimizerProvider(
        ADAPTER.validate_python({"name": "stochastic_adamw", "state_dtype": "bfloat16"})
    ).build(context)
    assert isinstance(optimizer, kernels.StochasticAdamW)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.weight)


def test_frozen_model_is_an_error() -> None:
    model = nn.Linear(3, 2).requires_grad_(False)
    context = OptimizerProviderContext(dist_context=_CpuContext(), model_stages=[model])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no trainable parameters"):
        AutoOptimizerProvider(ADAPTER.validate_python({"name": "adamw"})).build(context)


class _CpuContext:
    """The one field of DistributedContext the provider reads."""

    device_type = "cpu"
