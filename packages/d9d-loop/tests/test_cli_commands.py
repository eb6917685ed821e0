"""The ``d9d`` command: lr-plot, plot, inspect and export; bad input is exit status 2 naming the file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from loop_toy_job import ToyProvider, build_trainer, toy_config
from safetensors.torch import load_file

from d9d._loop_command import main
from d9d.mesh.testing import run_distributed


def toy_provider(config: Mapping[str, Any]) -> ToyProvider:
    """``--provider test_cli_commands:toy_provider``: the toy job's provider, whatever the config."""
    return ToyProvider("fsdp")


def wide_toy_provider(config: Mapping[str, Any]) -> ToyProvider:
    """A toy model twice as wide: not the model the checkpoint holds."""
    return ToyProvider("fsdp", hidden=32)


@pytest.mark.parametrize("command", ["lr-plot", "plot", "inspect", "export"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: d9d " + command in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),  # missing file
        ("", "is empty"),  # empty file
        ("trainer: [1, 2", "is not valid YAML"),  # invalid YAML
        ("- 1\n- 2\n", "must be a mapping"),  # YAML but not a mapping
        ("trainer: 3\n", "config.yaml: "),  # a section of the wrong type
        ("trainer: {max_steps: 10}\noptimizer: {name: nope}\n", "config.yaml: "),  # fails validation
    ],
)
def test_lr_plot_bad_config_is_exit_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    config = tmp_path / "config.yaml"
    if content is not None:
        config.write_text(content)
    assert main(["lr-plot", str(config), "-o", str(tmp_path / "lr.png")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("d9d lr-plot: ") and str(config) in error and message in error
    assert "Traceback" not in error
    assert not (tmp_path / "lr.png").exists()


def test_plot_draws_loss_lr_and_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 2.0 / s, "lr": 0.01, "tokens_per_s": 1000.0 + s} for s in range(1, 20)]
    metrics.write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"step": 19, "eval/loss": 0.2}) + "\n"
    )
    output = tmp_path / "m.png"
    assert main(["plot", str(metrics), "-o", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss, eval/loss, lr, tokens_per_s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),  # missing file
        ("", "holds no metrics rows"),  # empty file
        ('{"step": 1, "loss": 2}\n{oops\n', "metrics.jsonl:2: not valid JSON"),  # a malformed line
        ('{"loss": 2}\n', "metrics.jsonl:1: not a metrics row"),  # no step
        ('{"step": 1, "accuracy": 2}\n', "holds none of the metrics"),  # nothing to draw
    ],
)
def test_plot_bad_metrics_is_exit_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    if content is not None:
        metrics.write_text(content)
    assert main(["plot", str(metrics), "-o", str(tmp_path / "m.png")]) == 2
    error = capsys.readouterr().err
    assert str(metrics) in error and message in error
    assert not (tmp_path / "m.png").exists()


LORA = {"kind": "lora", "target": "fc1", "r": 2, "alpha": 4.0}


def _train_checkpoint_and_export(directory: str, peft: dict[str, Any] | None = None) -> None:
    root = Path(directory)
    trainer_section: dict[str, Any] = {
        "max_steps": 2,
        "checkpoint": {"directory": str(root / "ckpt"), "every_steps": 2},
    }
    if peft is not None:
        trainer_section["peft"] = peft
    config = toy_config(mesh={"data_parallel_shard": 2}, trainer=trainer_section)
    trainer = build_trainer(config, strategy="fsdp")
    trainer.train()
    trainer.export(root / "trainer-export")
    trainer.close()
    trainer.dist_context.close()


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


def _cli(argv: list[str]) -> int:
    return main(argv)


def test_export_and_inspect_of_a_checkpoint_saved_on_two_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_distributed(_train_checkpoint_and_export, str(tmp_path), world_size=2)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"seed": 0}}))
    argv = ["export", str(config), str(tmp_path / "ckpt"), str(tmp_path / "cli-export")]
    assert run_distributed(_cli, [*argv, "--provider", "test_cli_commands:toy_provider"], world_size=1) == [0]
    ours, theirs = _tensors(tmp_path / "cli-export"), _tensors(tmp_path / "trainer-export")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0)

    assert main(["inspect", str(tmp_path / "ckpt" / "step_000000002")]) == 0
    table = capsys.readouterr().out
    assert "DCP checkpoint" in table and "step: 2" in table and "model." in table and "float32" in table
    assert main(["inspect", str(tmp_path / "cli-export")]) == 0
    assert "safetensors" in capsys.readouterr().out

    # the target now holds an export: a second export replaces it; a user's folder is refused
    assert run_distributed(_cli, [*argv, "--provider", "test_cli_commands:toy_provider"], world_size=1) == [0]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    argv[-1] = str(mine)
    assert main([*argv, "--provider", "test_cli_commands:toy_provider"]) == 2
    assert "not a d9d export" in capsys.readouterr().err and (mine / "notes.txt").exists()

    # a checkpoint of another model is exit 2 naming it, and nothing is written
    argv[-1] = str(tmp_path / "wide")
    assert run_distributed(
        _cli, [*argv, "--provider", "test_cli_commands:wide_toy_provider"], world_size=1
    ) == [2]
    assert not (tmp_path / "wide").exists()


def test_export_of_a_lora_checkpoint_merges_the_adapters_as_the_job_does(tmp_path: Path) -> None:
    # The checkpoint holds only the adapters; the base comes from the seeded initialization, as
    # in training, and the export merges W + alpha/r * B @ A.
    run_distributed(_train_checkpoint_and_export, str(tmp_path), LORA, world_size=2)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"seed": 0, "peft": LORA}}))
    argv = ["export", str(config), str(tmp_path / "ckpt"), str(tmp_path / "cli-export")]
    assert run_distributed(_cli, [*argv, "--provider", "test_cli_commands:toy_provider"], world_size=1) == [0]
    ours, theirs = _tensors(tmp_path / "cli-export"), _tensors(tmp_path / "trainer-export")
    assert ours.keys() == theirs.keys() and not any("lora" in name for name in ours)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--provider", "nothing_here_module:f"], "module nothing_here_module is not installed"),
        (["--provider", "json"], "is not of the form module:function"),
        (["--provider", "json:no_such_function"], "json has no function no_such_function"),
    ],
)
def test_export_bad_provider_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("trainer: {}\n")
    checkpoint = tmp_path / "step_000000001"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(b"")
    assert main(["export", str(config), str(checkpoint), str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing", "does not exist"),  # nothing there
        ("empty-dir", "neither a DCP checkpoint"),  # a directory of nothing d9d knows
        ("broken.safetensors", "not a readable safetensors file"),  # a corrupt file
    ],
)
def test_inspect_bad_path_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: str, message: str
) -> None:
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "broken.safetensors").write_bytes(b"\x05\x00")
    assert main(["inspect", str(tmp_path / path)]) == 2
    error = capsys.readouterr().err
    assert str(tmp_path / path) in error and message in error
    assert main(["export", str(tmp_path / "no.yaml"), str(tmp_path), str(tmp_path / "out")]) == 2
    assert "no.yaml" in capsys.readouterr().err
