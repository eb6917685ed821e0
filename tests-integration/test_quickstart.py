"""The quickstart job: converges, and gives the same loss curve on every mesh layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quickstart_job import QUICKSTART, quickstart_config, run_quickstart

from d9d.mesh.testing import run_distributed

REPO = Path(__file__).resolve().parents[1]


def test_quickstart_script_converges_below_twice_the_noise_floor(tmp_path: Path) -> None:
    config = (REPO / "examples" / "quickstart" / "config.yaml").read_text()
    metrics = tmp_path / "metrics.jsonl"
    config = config.replace(
        "  seed: 0\n  gradient_clipping",
        f"  seed: 0\n  logging: {{tracker: {{name: jsonl, path: {metrics}}}}}\n  gradient_clipping",
        1,
    )
    path = tmp_path / "config.yaml"
    path.write_text(config)
    result = subprocess.run(
        [sys.executable, str(QUICKSTART), str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["step"] == 299
    final = sum(r["loss"] for r in records[-10:]) / 10
    assert final < 0.02, f"final loss {final} is not within 2x of the noise floor 0.01"
    assert "train" in result.stderr  # the progress bar


def _curve(mesh: dict[str, int]) -> list[float]:
    return run_quickstart(quickstart_config(mesh=mesh))["losses"]


@pytest.mark.parametrize(
    "mesh",
    [
        {"data_parallel_shard": 4},  # FSDP over 4 ranks
        {"data_parallel_replicate": 2, "data_parallel_shard": 2},  # HSDP 2x2
    ],
)
def test_four_ranks_match_single_process_loss_curve(mesh: dict[str, int]) -> None:
    reference = run_quickstart(quickstart_config())["losses"]
    curves = run_distributed(_curve, mesh, world_size=4, timeout_s=240)
    assert len(reference) == 12
    for rank_curve in curves:
        torch.testing.assert_close(torch.tensor(rank_curve), torch.tensor(reference), rtol=1e-4, atol=0)
