"""examples/rl-grpo: in a short CPU run the mean reward and the greedy accuracy rise clearly; the run
shows its progress and leaves checkpoints a rerun resumes from."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from script_runner import run_script

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "rl-grpo"


def test_grpo_example_reward_and_accuracy_rise(tmp_path: Path, torch_runner: subprocess.Popen[str]) -> None:
    report = tmp_path / "rewards.json"
    # `python train.py ...` in a process of its own (forked by the script runner, see script_runner)
    result = run_script(
        torch_runner,
        EXAMPLE / "train.py",
        str(EXAMPLE / "config.yaml"),
        "--steps",
        "30",
        "--report",
        str(report),
        cwd=tmp_path,  # the config's runs/rl-grpo/checkpoints lands here
        timeout_s=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "30/30" in result.stderr, result.stderr[-3000:]  # the progress bar reached the last step
    checkpoints = tmp_path / "runs" / "rl-grpo" / "checkpoints"
    assert (checkpoints / "step_000000030").is_dir(), sorted(p.name for p in checkpoints.iterdir())
    measured = json.loads(report.read_text())
    rewards = measured["rewards"]
    assert measured["steps"] == list(range(30)) and len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # chance is about 0.1 (1/16 for the digit, 0.5/16 for the end token); the run ends far above it
    assert first < 0.2, rewards
    assert last > first + 0.25, rewards
    # greedy answers over all 55 prompts: none right at initialization (seed 0), 10 of 55 after
    # 30 steps here; the run is seeded, so the margin guards against a regression, not noise
    before, after = measured["accuracy_before"], measured["accuracy_after"]
    assert after >= before + 0.1, measured
