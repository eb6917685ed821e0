"""Builds the configured optimizer over all local model stages."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from d9d.loop._providers import OptimizerProviderContext
from d9d.loop.config._optimizer import (
    AdamConfig,
    AdamWConfig,
    OptimizerConfig,
    SGDConfig,
    StochasticAdamWConfig,
)
from d9d.loop.estimate._job import OptimizerMemory, optimizer_memory


def _trainable(context: OptimizerProviderContext) -> list[nn.Parameter]:
    params = [p for stage in context.model_stages for p in stage.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model stages on this rank have no trainable parameters")
    return params


def kernels_name(name: str) -> Callable[..., Any]:
    """A callable of d9d-kernels, found by name (d9d-loop does not depend on d9d-kernels)."""
    try:
        kernels = importlib.import_module("d9d.kernels")
    except ImportError as e:
        raise ValueError(
            "optimizer.name='stochastic_adamw' needs the d9d-kernels package: pip install d9d-kernels"
        ) from e
    found = getattr(kernels, name, None)
    if found is None:
        raise ValueError(f"the installed d9d-kernels has no {name} (optimizer.name='stochastic_adamw')")
    return cast(Callable[..., Any], found)


def _stochastic_adamw(
    config: StochasticAdamWConfig, params: list[nn.Parameter], context: OptimizerProviderContext
) -> torch.optim.Optimizer:
    options: dict[str, Any] = {}
    if config.offload is not None:
        # Refuses, naming the bytes, when the host cannot hold the moments (before allocating any).
        options["offload"] = kernels_name("HostStateOffload")(
            chunk_bytes=config.offload.chunk_mib * 2**20,
            resident_bytes=config.offload.resident_mib * 2**20,
            processes_per_host=context.dist_context.local_world_size,  # the host's ranks share it
        )
    optimizer = kernels_name("StochasticAdamW")(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        state_dtype=getattr(torch, config.state_dtype),
        **options,
    )
    return cast(torch.optim.Optimizer, optimizer)


class AutoOptimizerProvider:
    """Builds the optimizer named by an ``OptimizerConfig``.

    AdamW and Adam use the fused implementation on CUDA and the multi-tensor (foreach) one
    elsewhere.
    """

    def __init__(self, config: OptimizerConfig) -> None:
        self._config = config

    def optimizer_memory(self, *, storage_bytes: int) -> OptimizerMemory:
        """What the optimizer keeps per trained element (for the memory estimate)."""
        return optimizer_memory(self._config, storage_bytes=storage_bytes)

    def build(self, context: OptimizerProviderContext) -> torch.optim.Optimizer:
        params = _trainable(context)
        on_cuda = context.dist_context.device_type == "cuda"
        speed: dict[str, Any] = {"fused": True} if on_cuda else {"foreach": True}
        config = self._config
        match config:
            case AdamWConfig():
                return torch.optim.AdamW(
                    params,
                    lr=config.lr,
                    betas=config.betas,
                    eps=config.eps,
                    weight_decay=config.weight_decay,
                    **speed,
                )
            case AdamConfig():
                return torch.optim.Adam(
                    params,
                    lr=config.lr,
                    betas=config.betas,
                    eps=config.eps,
                    weight_decay=config.weight_decay,
                    **speed,
                )
            case SGDConfig():
                return torch.optim.SGD(
                    params,
                    lr=config.lr,
                    momentum=config.momentum,
                    nesterov=config.nesterov,
                    weight_decay=config.weight_decay,
                    foreach=True,
                )
            case StochasticAdamWConfig():
                return _stochastic_adamw(config, params, context)
