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


def _trainable(context: OptimizerProviderContext) -> list[nn.Parameter]:
    params = [p for stage in context.model_stages for p in stage.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model stages on this rank have no trainable parameters")
    return params


def _stochastic_adamw_class() -> Callable[..., torch.optim.Optimizer]:
    try:
        kernels = importlib.import_module("d9d.kernels")
    except ImportError as e:
        raise ValueError(
            "optimizer.name='stochastic_adamw' needs the d9d-kernels package: pip install d9d-kernels"
        ) from e
    optimizer_class = getattr(kernels, "StochasticAdamW", None)
    if optimizer_class is None:
        raise ValueError("the installed d9d-kernels has no StochasticAdamW optimizer")
    return cast(Callable[..., torch.optim.Optimizer], optimizer_class)


class AutoOptimizerProvider:
    """Builds the optimizer named by an ``OptimizerConfig``.

    AdamW and Adam use the fused implementation on CUDA and the multi-tensor (foreach) one
    elsewhere.
    """

    def __init__(self, config: OptimizerConfig) -> None:
        self._config = config

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
                optimizer_class = _stochastic_adamw_class()
                return optimizer_class(
                    params,
                    lr=config.lr,
                    betas=config.betas,
                    eps=config.eps,
                    weight_decay=config.weight_decay,
                    state_dtype=getattr(torch, config.state_dtype),
                )
