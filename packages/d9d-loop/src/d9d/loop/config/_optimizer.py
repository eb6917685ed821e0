"""Optimizer choices, as a discriminated union on ``name``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _check_betas(betas: tuple[float, float]) -> tuple[float, float]:
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{index}]={beta} is outside [0, 1)")
    return betas


Betas = Annotated[tuple[float, float], AfterValidator(_check_betas)]
"""Adam's two decay rates, each in [0, 1)."""


class _OptimizerBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class AdamWConfig(_OptimizerBase):
    """``torch.optim.AdamW`` (fused kernel on CUDA, foreach elsewhere)."""

    name: Literal["adamw"] = "adamw"
    betas: Betas = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)


class AdamConfig(_OptimizerBase):
    """``torch.optim.Adam``."""

    name: Literal["adam"] = "adam"
    betas: Betas = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)


class SGDConfig(_OptimizerBase):
    """``torch.optim.SGD`` with optional momentum."""

    name: Literal["sgd"] = "sgd"
    momentum: float = Field(default=0.0, ge=0, lt=1)
    nesterov: bool = False


class StochasticAdamWConfig(_OptimizerBase):
    """d9d-kernels' AdamW for bf16 parameters with stochastic rounding (needs d9d-kernels)."""

    name: Literal["stochastic_adamw"] = "stochastic_adamw"
    betas: Betas = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    state_dtype: Literal["float32", "bfloat16"] = "float32"


OptimizerConfig = Annotated[
    AdamWConfig | AdamConfig | SGDConfig | StochasticAdamWConfig, Field(discriminator="name")
]
