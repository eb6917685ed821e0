"""Runs the quickstart model with a given config inside a test process (one rank or many)."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    EventBus,
    ForwardBackwardFinished,
    ProjectConfig,
    StepFinished,
    Trainer,
    TrainingConfigurator,
)

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "train.py"


def load_quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("d9d_quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_trainer(config: ProjectConfig, events: EventBus, *, num_samples: int = 4096) -> Trainer:
    """The quickstart's trainer on ``config`` (regression samples of 16 features), with ``events``."""
    qs = load_quickstart()
    return TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=qs.MLPProvider(),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda dist_context: qs.RegressionDataset(num_samples, 16),
            collator=qs.RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
    ).configure()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (DTensors are gathered: a collective, call it on every rank)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def quickstart_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "mesh": {},
        "trainer": {
            "max_steps": 12,
            "global_batch_size": 64,
            "microbatch_size": 8,
            "seed": 3,
            "logging": {"progress_bar": False},
            "device": "cpu",  # gloo ranks on CPU even where a GPU exists
        },
        "data": {"seed": 5},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "lr_scheduler": {
            "name": "piecewise",
            "warmup": {"steps": 3},
            "phases": [{"kind": "cosine", "fraction": 1.0}],
        },
    }
    for key, value in overrides.items():
        section = config.setdefault(key, {})
        section.update(value)
    return config


def run_quickstart(
    raw_config: dict[str, Any],
    *,
    kill_at_step: int | None = None,
    kill_during_save_at_step: int | None = None,
    num_samples: int = 4096,
) -> dict[str, Any]:
    """Trains; returns per-step losses, and final full parameters on rank 0."""
    config = ProjectConfig.model_validate(raw_config)
    events = EventBus()
    losses: list[float] = []
    events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    if kill_at_step is not None:

        def kill(event: StepFinished) -> None:
            if event.step == kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)

        events.subscribe(StepFinished, kill)
    if kill_during_save_at_step is not None:
        directory = Path(raw_config["trainer"]["checkpoint"]["directory"])
        partial = directory / f"step_{kill_during_save_at_step:09d}.partial"

        def watch() -> None:
            while True:
                if partial.is_dir() and any(partial.iterdir()):
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()
    trainer = build_trainer(config, events, num_samples=num_samples)
    trainer.train()
    params = full_parameters(trainer.model_stages[0])
    trainer.close()  # the trainer owns the context it built: this releases it too
    return {"losses": losses, "params": params, "start_step": trainer.total_steps - len(losses)}
