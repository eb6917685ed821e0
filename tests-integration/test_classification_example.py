"""examples/classification: a short CPU run reports AUROC and F1 on the held-out split, AUROC
well above chance, and the inference pass writes one JSONL line per held-out sample."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from script_in_process import run_script_in_process
from script_runner import run_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "classification"


# Both end before any work: run in this process (see script_in_process), not a fresh interpreter.
def test_script_without_arguments_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = run_script_in_process(EXAMPLE / "train.py", capsys=capsys)
    assert code == 2
    assert "usage: train.py CONFIG.yaml" in stderr


def test_a_missing_config_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    code, stderr = run_script_in_process(EXAMPLE / "train.py", str(missing), capsys=capsys)
    assert code == 2
    assert str(missing) in stderr


def _run(
    config: str, tmp_path: Path, runner: subprocess.Popen[str], *, timeout: int
) -> subprocess.CompletedProcess[str]:
    """``python train.py CONFIG`` in a process of its own (forked by the script runner)."""
    path = tmp_path / "config.yaml"
    path.write_text(config)
    return run_script(runner, EXAMPLE / "train.py", str(path), cwd=tmp_path, timeout_s=timeout)


def test_a_short_run_reports_auroc_and_f1_and_writes_predictions(
    tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> None:
    config = (EXAMPLE / "config.yaml").read_text()
    config = config.replace("runs/classification", str(tmp_path / "runs"))
    for old, new in [
        ("max_steps: 60", "max_steps: 24"),
        ("every_steps: 20", "every_steps: 12"),
        ("train_samples: 2048", "train_samples: 768"),
        ("eval_samples: 256", "eval_samples: 100"),  # not a multiple of the inference batch (64)
        ("warmup: {steps: 10}", "warmup: {steps: 3}"),
        ("lr: 0.003", "lr: 0.005"),
    ]:
        assert old in config, old
        config = config.replace(old, new)
    result = _run(config, tmp_path, torch_runner, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    pattern = r"eval after (\d+) steps: eval/loss=([\d.]+) eval/auroc=([\d.]+) eval/f1=([\d.]+)"
    reports = [(int(s), float(auroc), float(f1)) for s, _, auroc, f1 in re.findall(pattern, result.stdout)]
    assert [s for s, _, _ in reports] == [12, 24], result.stdout
    _, auroc, f1 = reports[-1]
    assert auroc > 0.8, result.stdout
    assert 0.0 < f1 <= 1.0

    lines = (tmp_path / "runs" / "predictions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 100
    assert [r["id"] for r in records] == list(range(768, 868))
    assert all(r["label"] in (0, 1) and 0.0 <= r["score"] <= 1.0 for r in records)
    assert (tmp_path / "runs" / "export" / "config.json").is_file()


def test_an_export_dir_holding_other_files_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = (EXAMPLE / "config.yaml").read_text().replace("runs/classification", str(tmp_path / "runs"))
    export = tmp_path / "runs" / "export"
    export.mkdir(parents=True)
    (export / "notes.txt").write_text("mine")
    path = tmp_path / "config.yaml"
    path.write_text(config)
    # Refused before any work (no process group either): in this process, see script_in_process.
    code, stderr = run_script_in_process(EXAMPLE / "train.py", str(path), capsys=capsys)
    assert code == 2, stderr[-2000:]
    assert "not a d9d export" in stderr and "replace_export_dir" in stderr
    assert (export / "notes.txt").read_text() == "mine"
