"""The Qwen3-MoE pre-training example under torchrun: PP x EP x FSDP on 4 CPU ranks trains and exports."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from script_in_process import run_script_in_process

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "pretrain-qwen3-moe" / "train.py"


def test_a_short_run_under_torchrun_lowers_the_loss_and_exports(tmp_path: Path) -> None:
    config = (REPO / "examples" / "pretrain-qwen3-moe" / "config.yaml").read_text()
    assert "mesh: {pipeline_parallel: 2, data_parallel_shard: 2, expert_parallel: 2}" in config
    config = config.replace("runs/pretrain-qwen3-moe", str(tmp_path / "runs"))
    config = config.replace("max_steps: 60", "max_steps: 12").replace("every_steps: 20", "every_steps: 10")
    path = tmp_path / "config.yaml"
    path.write_text(config)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(SCRIPT), str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "12/12" in result.stderr, result.stderr[-3000:]  # the main rank's progress bar reached the end
    match = re.search(r"loss: first ([\d.]+), last ([\d.]+)", result.stdout)
    assert match is not None, result.stdout
    first, last = float(match.group(1)), float(match.group(2))
    assert last < 0.9 * first  # 4.86 -> 3.94 in 12 steps (warm-up 5)
    export = tmp_path / "runs" / "export"
    assert (export / "config.json").is_file()
    assert (export / "model.safetensors.index.json").is_file()
    assert (tmp_path / "runs" / "checkpoints" / "step_000000010").is_dir()


def test_an_export_dir_holding_other_files_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The example exported with overwrite=True unchecked: a user's files in export_dir were
    # deleted, exit status 0, nothing printed.
    config = (REPO / "examples" / "pretrain-qwen3-moe" / "config.yaml").read_text()
    config = config.replace("runs/pretrain-qwen3-moe", str(tmp_path / "runs"))
    export = tmp_path / "runs" / "export"
    export.mkdir(parents=True)
    (export / "notes.txt").write_text("mine")
    path = tmp_path / "config.yaml"
    path.write_text(config)
    # Refused before any work (no process group either): in this process, see script_in_process.
    code, stderr = run_script_in_process(SCRIPT, str(path), capsys=capsys)
    assert code == 2, stderr[-2000:]
    assert f"export target {export} is a non-empty directory that is not a d9d export" in stderr
    assert "notes.txt" in stderr and "pretrain.replace_export_dir: true" in stderr
    assert (export / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "runs" / "checkpoints").exists()  # refused before any work


def test_the_config_trains_with_the_load_balancing_loss_its_readme_promises() -> None:
    # the README says "load-balancing loss on": config.json's output_router_logits must say so
    # (transformers, and d9d by default, add the loss only when it is true)
    import yaml

    from d9d.hf import HFModelProvider, ScratchModelConfig
    from d9d.mesh import DistributedContext, MeshParameters

    assert "load-balancing loss on" in (SCRIPT.parent / "README.md").read_text()
    model = yaml.safe_load((SCRIPT.parent / "config.yaml").read_text())["model"]
    context = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        spec = HFModelProvider(ScratchModelConfig.model_validate(model)).model_config(context).decoder_spec()
    finally:
        context.close()
    assert spec.load_balancing and spec.load_balancing_coefficient == model["config"]["router_aux_loss_coef"]
