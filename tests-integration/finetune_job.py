"""The finetune-qwen3 example's own ``run()`` on a config, observed on every rank.

Usage: ``python finetune_job.py CONFIG.yaml OUT_DIR`` (under ``torchrun`` for the two-node test of
test_multi_node_finetune.py; also callable in a process as ``run_job``).

The example's train.py does the work (toy data, tiny Qwen3, SFT data, HSDP or any mesh, resume,
export); this script only subscribes to its trainer's events. Each rank writes
``OUT_DIR/rank<R>.pt``: its per-step losses, the step it started from, the full parameters right
after resume (before its first step), at each saved checkpoint, and when training finished.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from quickstart_job import full_parameters
from torch import nn

from d9d.loop import (
    CheckpointSaved,
    EventBus,
    ForwardBackwardFinished,
    ModelReady,
    StepStarted,
    TrainingFinished,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune-qwen3"


def load_example() -> ModuleType:
    """examples/finetune-qwen3/train.py as a module (its toy_setup importable next to it)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("finetune_qwen3_train", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the config's annotations there
    spec.loader.exec_module(module)
    return module


def run_job(config_path: Path, out: Path) -> dict[str, Any]:
    """Runs the example on ``config_path``; returns (and saves to ``out``) what this rank saw."""
    example = load_example()
    config = example.FinetuneConfig.from_yaml(config_path)
    events = EventBus()
    seen: dict[str, Any] = {"losses": [], "first_step": None, "resumed": None, "saved": {}}
    models: list[nn.Module] = []

    def first_step(event: StepStarted) -> None:
        if seen["first_step"] is None:
            seen["first_step"] = event.step
            seen["resumed"] = full_parameters(models[0])

    events.subscribe(ModelReady, lambda e: models.extend(e.model_stages))
    events.subscribe(StepStarted, first_step)
    events.subscribe(ForwardBackwardFinished, lambda e: seen["losses"].append(e.loss))
    events.subscribe(CheckpointSaved, lambda e: seen["saved"].update({e.step: full_parameters(models[0])}))
    events.subscribe(TrainingFinished, lambda e: seen.update(params=full_parameters(models[0])))
    example.run(config, events=events)
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(seen, out / f"rank{rank}.pt")
    return seen


if __name__ == "__main__":
    run_job(Path(sys.argv[1]), Path(sys.argv[2]))
