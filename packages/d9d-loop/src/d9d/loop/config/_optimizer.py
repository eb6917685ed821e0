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


class HostOffloadConfig(BaseModel):
    """The optimizer's moments in pinned host memory, streamed through the device at each step.

    The device then holds the parameters, the gradients and two chunks of moments instead of all
    moments (for Qwen3-4B with bf16 moments: 15 GiB less). Each step copies every moment in and
    out over the host link (PCIe), chunk by chunk, overlapping the copies with the fused step; the
    arithmetic is the on-device step's. The optimizer refuses to start when the host has less
    free memory than the moments need.

    Attributes:
        chunk_mib: MiB of moments per chunk; the device holds two chunks for the step.
        resident_mib: MiB of moments (those of the first parameters that fit) that stay on the
            device: memory the device has to spare, spent on copying less at each step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_mib: int = Field(default=512, gt=0)
    resident_mib: int = Field(default=0, ge=0)


class StochasticAdamWConfig(_OptimizerBase):
    """d9d-kernels' AdamW for bf16 parameters with stochastic rounding (needs d9d-kernels).

    Attributes:
        state_dtype: Dtype of the two moments.
        offload: Keep the moments in host memory (``offload: {}`` for the defaults); on the device
            when None.
    """

    name: Literal["stochastic_adamw"] = "stochastic_adamw"
    betas: Betas = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    offload: HostOffloadConfig | None = None


OptimizerConfig = Annotated[
    AdamWConfig | AdamConfig | SGDConfig | StochasticAdamWConfig, Field(discriminator="name")
]
