"""Runs of the toy job that report what happened instead of raising (for the reliability tests)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from loop_toy_job import build_trainer, full_parameters, toy_config

from d9d.loop import ForwardBackwardFinished, OptimizerStepFinished


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_toy(
    directory: str | None,
    *,
    max_steps: int,
    trainer: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
    optimizer: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    lr_scheduler: dict[str, Any] | None = None,
    mesh: dict[str, int] | None = None,
    hidden: int = 16,
    samples: int = 512,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Trains the toy job; returns losses, warnings, the error (as text) and the final parameters."""
    handler = _Collect()
    logging.getLogger("d9d").addHandler(handler)
    section: dict[str, Any] = {"max_steps": max_steps, **(trainer or {})}
    if directory is not None:
        section["checkpoint"] = {
            "directory": directory,
            "every_steps": 1,
            "keep_last": 3,
            **(checkpoint or {}),
        }
    sections: dict[str, dict[str, Any]] = {"trainer": section}
    if optimizer is not None:
        sections["optimizer"] = optimizer
    if data is not None:
        sections["data"] = data
    if lr_scheduler is not None:
        sections["lr_scheduler"] = lr_scheduler
    if mesh is not None:
        sections["mesh"] = dict(mesh)
    losses: list[float] = []
    lrs: list[float] = []
    error: BaseException | None = None
    built = None
    try:
        built = build_trainer(
            toy_config(**sections), strategy="fsdp", hidden=hidden, samples=samples, dtype=dtype
        )
        built.events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
        built.events.subscribe(OptimizerStepFinished, lambda e: lrs.append(e.learning_rate))
        built.train()
    except Exception as e:  # reported to the test; every reliability error is an Exception
        error = e
    params: dict[str, torch.Tensor] = {}
    step = -1
    if built is not None:
        params = full_parameters(built)
        step = built.step
        built.close()
        built.dist_context.close()
    logging.getLogger("d9d").removeHandler(handler)
    return {
        "losses": losses,
        "lrs": lrs,
        "warnings": handler.messages,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "params": params,
        "step": step,
    }


def checkpoints(directory: Path) -> list[str]:
    """Names in a checkpoint directory, sorted."""
    return sorted(p.name for p in directory.iterdir())
