"""``d9d export`` / ``d9d inspect`` refuse a damaged checkpoint and a checkpoint of another model."""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from loop_toy_job import ToyModel, ToyProvider, build_trainer, toy_config
from torch import nn

from d9d._loop_command import main
from d9d.loop import InitializeModelStageContext, InitializeModelStageResult
from d9d.loop.checkpoint._manifest import MANIFEST_FILE
from d9d.mesh.testing import run_distributed
from d9d.state_mappers import identity_mapper_from_module


class _ReshapedProvider(ToyProvider):
    """The toy model with ``fc2`` replaced (``bias``: kept or dropped) and an ``extra`` tensor or not."""

    def __init__(self, *, bias: bool, extra: bool) -> None:
        super().__init__("fsdp")
        self.bias = bias
        self.extra = extra

    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[ToyModel]:
        model = ToyModel(self.hidden)
        model.fc2 = nn.Linear(self.hidden, 1, bias=self.bias)
        if self.extra:
            model.register_parameter("extra", nn.Parameter(torch.zeros(3)))
        return InitializeModelStageResult(model=model, state_mapper=identity_mapper_from_module(model))


def toy_provider(config: Mapping[str, Any]) -> ToyProvider:
    return ToyProvider("fsdp")


def fewer_tensors_provider(config: Mapping[str, Any]) -> ToyProvider:
    """The checkpoint's ``model.fc2.bias`` is not this model's (the wrong-family case)."""
    return _ReshapedProvider(bias=False, extra=False)


def more_tensors_provider(config: Mapping[str, Any]) -> ToyProvider:
    """This model's ``extra`` is not in the checkpoint."""
    return _ReshapedProvider(bias=True, extra=True)


def _train(directory: str) -> None:
    trainer_section = {"max_steps": 2, "checkpoint": {"directory": directory, "every_steps": 2}}
    trainer = build_trainer(toy_config(trainer=trainer_section), strategy="fsdp")
    trainer.train()
    trainer.close()
    trainer.dist_context.close()


def _cli(argv: list[str]) -> tuple[int, str]:
    error = io.StringIO()
    with contextlib.redirect_stderr(error):
        code = main(argv)
    return code, error.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    run_distributed(_train, str(root / "ckpt"), world_size=1)
    (root / "config.yaml").write_text(yaml.safe_dump({"trainer": {"seed": 0}}))
    return root


@pytest.fixture
def checkpoint(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step_000000002"
    shutil.copytree(saved / "ckpt" / "step_000000002", copy)
    return copy


def _export(saved: Path, checkpoint: Path, target: Path, provider: str) -> tuple[int, str]:
    """Exit status and stderr of ``d9d export`` (in a rank of its own: it sets up a process group)."""
    argv = ["export", str(saved / "config.yaml"), str(checkpoint), str(target)]
    (result,) = run_distributed(
        _cli, [*argv, "--provider", f"test_cli_checkpoint_checks:{provider}"], world_size=1
    )
    return result


def _data_files(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("*.distcp"))


def test_an_intact_checkpoint_is_listed_as_checked(
    saved: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(checkpoint)]) == 0
    assert "sizes and CRC-32 as the manifest records" in capsys.readouterr().out


def test_a_flipped_byte_refuses_export_and_inspect_naming_the_file(
    saved: Path, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = _data_files(checkpoint)[0]
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    assert main(["inspect", str(checkpoint)]) == 2
    error = capsys.readouterr().err
    assert str(damaged) in error and "CRC-32" in error and "they hold model." in error, error
    code, error = _export(saved, checkpoint, tmp_path / "out", "toy_provider")
    assert code == 2 and str(damaged) in error and "CRC-32" in error, error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("manifest", [True, False])
def test_a_truncated_file_refuses_inspect_naming_it(
    checkpoint: Path, capsys: pytest.CaptureFixture[str], manifest: bool
) -> None:
    if not manifest:  # an older d9d's checkpoint: .metadata still says where each tensor ends
        (checkpoint / MANIFEST_FILE).unlink()
    damaged = _data_files(checkpoint)[0]
    damaged.write_bytes(damaged.read_bytes()[:-64])
    assert main(["inspect", str(checkpoint)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("d9d inspect: ") and str(damaged) in error and "bytes" in error, error


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        ("fewer_tensors_provider", "1 tensors of the checkpoint are not the model's: model.fc2.bias"),
        ("more_tensors_provider", "model.extra [3] is not in the checkpoint"),
    ],
)
def test_a_checkpoint_of_another_model_refuses_export_naming_the_tensors(
    saved: Path,
    checkpoint: Path,
    tmp_path: Path,
    provider: str,
    message: str,
) -> None:
    code, error = _export(saved, checkpoint, tmp_path / "out", provider)
    assert code == 2 and error.startswith("d9d export: ") and message in error, error
    assert str(checkpoint) in error and error.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_intact_checkpoint_exports(saved: Path, checkpoint: Path, tmp_path: Path) -> None:
    code, error = _export(saved, checkpoint, tmp_path / "out", "toy_provider")
    assert code == 0, error
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
