# ruff: noqa: E501  (the embedded source is written as a user would, on long lines)
"""Typed contexts: a task that reads a field its State lacks is a pyright error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TASK = """
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from d9d.loop import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    TrainTask,
)


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Input:
    x: torch.Tensor


@dataclass
class State:
    y: torch.Tensor


class Task(TrainTask[Batch, Input, None, torch.Tensor, State]):
    def build_forward_inputs(self, ctx: BuildForwardInputsContext[Batch]) -> BuildForwardInputsResult[Input, None, State]:
        return BuildForwardInputsResult(input=Input(x=ctx.batch.x), shared=None, state=State(y=ctx.batch.y))

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, State]) -> ComputeLossResult:
        return ComputeLossResult(loss=F.mse_loss(ctx.pipeline_results, ctx.state.{field}))
"""


def _pyright(tmp_path: Path, field: str) -> subprocess.CompletedProcess[str]:
    source = tmp_path / "task.py"
    source.write_text(TASK.replace("{field}", field))
    (tmp_path / "pyrightconfig.json").write_text(
        f'{{"typeCheckingMode": "strict", "pythonVersion": "3.11", "reportMissingTypeStubs": false, '
        f'"reportUnknownMemberType": false, "venvPath": "{Path(sys.prefix).parent}", "venv": "{Path(sys.prefix).name}"}}'
    )
    executable = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if executable is None:
        pytest.skip("pyright is not installed in this environment")
    return subprocess.run(
        [executable, str(source)], cwd=tmp_path, capture_output=True, text=True, check=False, timeout=240
    )


def test_existing_state_field_type_checks(tmp_path: Path) -> None:
    result = _pyright(tmp_path, "y")
    assert result.returncode == 0, result.stdout


def test_missing_state_field_is_a_pyright_error(tmp_path: Path) -> None:
    result = _pyright(tmp_path, "labels")
    assert result.returncode != 0
    assert 'Cannot access attribute "labels" for class "State"' in result.stdout, result.stdout
