"""The ``d9d`` command's edges: one line (no traceback) for bad input, ``--help`` without torch."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from d9d._loop_command import main

BINARY = bytes(range(256)) * 4  # not UTF-8 from byte 128 on


def _one_line_error(capsys: pytest.CaptureFixture[str], command: str, *names: str) -> str:
    error = capsys.readouterr().err
    assert error.startswith(f"d9d {command}: ") and error.count("\n") == 1, error
    assert "Traceback" not in error
    for name in names:
        assert name in error, (name, error)
    return error


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("trainer: {max_steps: 10}\noptimizer: {name: adamw, lr: 0.001}\n")
    return path


@pytest.fixture
def metrics(tmp_path: Path) -> Path:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    return path


@pytest.mark.parametrize("command", ["lr-plot", "plot"])
def test_a_binary_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    binary = tmp_path / "input.bin"
    binary.write_bytes(BINARY)
    assert main([command, str(binary), "-o", str(tmp_path / "out.png")]) == 2
    _one_line_error(capsys, command, str(binary), "not a text file")
    assert not (tmp_path / "out.png").exists()


def test_a_binary_export_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "config.yaml"
    binary.write_bytes(BINARY)
    assert main(["export", str(binary), str(tmp_path), str(tmp_path / "out")]) == 2
    _one_line_error(capsys, "export", str(binary), "not a text file")


def test_a_binary_config_json_beside_safetensors_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes(BINARY)
    assert main(["inspect", str(tmp_path)]) == 2
    _one_line_error(capsys, "inspect", str(tmp_path / "config.json"))


@pytest.mark.parametrize(("command", "fixture"), [("lr-plot", "config"), ("plot", "metrics")])
@pytest.mark.parametrize("output", ["missing/out.png", "out.txt", "out"])
def test_a_bad_picture_output_is_one_line_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
    command: str,
    fixture: str,
    output: str,
) -> None:
    source: Path = request.getfixturevalue(fixture)
    target = tmp_path / output
    assert main([command, str(source), "-o", str(target)]) == 2
    error = _one_line_error(capsys, command, str(target))
    assert ("does not exist" in error) if "/" in output else (".png, .svg, .pdf" in error)
    assert not target.exists()


def test_an_export_into_a_missing_folder_is_one_line(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "typo" / "out"
    assert main(["export", str(config), str(tmp_path), str(target)]) == 2
    _one_line_error(capsys, "export", str(tmp_path / "typo"), "does not exist")
    assert not (tmp_path / "typo").exists()


_HELP_WITHOUT_TORCH = """
import sys
from d9d._loop_command import main
for argv in ([], ["lr-plot"], ["plot"], ["inspect"], ["export"]):
    try:
        main([*argv, "--help"])
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
heavy = [m for m in ("torch", "numpy", "pydantic", "yaml", "matplotlib", "d9d.loop") if m in sys.modules]
print("heavy:", heavy)
"""


def test_help_of_every_subcommand_imports_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _HELP_WITHOUT_TORCH], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage: d9d export" in result.stdout and "trusted input" in result.stdout
    assert result.stdout.rstrip().endswith("heavy: []"), result.stdout[-500:]


def test_the_console_script_is_the_light_entry_point() -> None:
    (script,) = entry_points(group="console_scripts", name="d9d")
    assert script.value == "d9d._loop_command:main"
