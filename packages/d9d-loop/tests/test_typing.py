# ruff: noqa: E501  (the embedded source is written as a user would, on long lines)
"""Typed contexts: a task that reads a field its State lacks is a pyright error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# The task with a field its State has, and with one it lacks: both checked by one pyright run
# (its start-up, which reads torch's stubs, is most of a run's time).
FIELDS = {"existing": "y", "missing": "labels"}


@pytest.fixture(scope="module")
def diagnostics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """pyright's diagnostics of each task file (strict mode), by the file's key in ``FIELDS``."""
    directory = tmp_path_factory.mktemp("typing")
    for name, field in FIELDS.items():
        (directory / f"{name}.py").write_text(TASK.replace("{field}", field))
    (directory / "pyrightconfig.json").write_text(
        f'{{"typeCheckingMode": "strict", "pythonVersion": "3.11", "reportMissingTypeStubs": false, '
        f'"reportUnknownMemberType": false, "venvPath": "{Path(sys.prefix).parent}", "venv": "{Path(sys.prefix).name}"}}'
    )
    executable = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if executable is None:
        pytest.skip("pyright is not installed in this environment")
    files = [str(directory / f"{name}.py") for name in FIELDS]
    result = subprocess.run(
        [executable, "--outputjson", *files],
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    report = json.loads(result.stdout)
    assert report["summary"]["filesAnalyzed"] == len(FIELDS), result.stdout
    return {
        name: [d for d in report["generalDiagnostics"] if Path(d["file"]).name == f"{name}.py"]
        for name in FIELDS
    }


def test_existing_state_field_type_checks(diagnostics: dict[str, list[dict[str, Any]]]) -> None:
    errors = [d for d in diagnostics["existing"] if d["severity"] == "error"]
    assert not errors, errors


def test_missing_state_field_is_a_pyright_error(diagnostics: dict[str, list[dict[str, Any]]]) -> None:
    errors = [d["message"] for d in diagnostics["missing"] if d["severity"] == "error"]
    assert any('Cannot access attribute "labels" for class "State"' in message for message in errors), errors
