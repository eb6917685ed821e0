"""The fine-tuning example: a short run lowers the held-out loss and its export loads in transformers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "finetune-qwen3" / "train.py"


def test_script_without_arguments_prints_usage() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2
    assert "usage: train.py CONFIG.yaml" in result.stderr


def test_a_short_run_lowers_the_held_out_loss_and_exports_for_transformers(tmp_path: Path) -> None:
    config = (REPO / "examples" / "finetune-qwen3" / "config.yaml").read_text()
    config = config.replace("runs/finetune-qwen3", str(tmp_path / "runs"))
    config = config.replace("max_steps: 150", "max_steps: 30").replace(
        "warmup: {steps: 10}", "warmup: {steps: 3}"
    )
    path = tmp_path / "config.yaml"
    path.write_text(config)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"held-out loss before: ([\d.]+)\s+after: ([\d.]+)", result.stdout)
    assert match is not None, result.stdout
    before, after = float(match.group(1)), float(match.group(2))
    assert after < 0.5 * before

    from transformers import AutoModelForCausalLM

    export = tmp_path / "runs" / "export"
    assert (export / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()
