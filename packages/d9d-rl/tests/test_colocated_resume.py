"""A colocated GRPO run that crashes and resumes from its checkpoint equals the uninterrupted run.

Bit for bit: the rewards of every rollout, the loss of every step and the final weights. The
rollouts' randomness (prompts, sampling) must come back with the checkpoint, not restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from rl_tiny_model import VOCAB, tiny_config

from d9d.hf import DecoderCausalLM, HFModelProvider, ScratchModelConfig
from d9d.loop import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ForwardBackwardFinished,
    ProjectConfig,
    StepFailedError,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed
from d9d.rl import ColocatedRollouts, EmbeddedRolloutEngine, GRPOTask, SamplingParams, rollout_seed

STEPS = 4
CRASH_AT = 3  # the first attempt fails in step 3's rollout, after the step-2 checkpoint
SAMPLING = SamplingParams(samples_per_prompt=4, max_tokens=3, temperature=1.0)


def _prompts(*, step: int, dp_rank: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return [[int(t) for t in torch.randint(2, VOCAB, (3,), generator=generator)] for _ in range(count)]


@dataclass(kw_only=True)
class _Reward:
    """1 for a first token up to VOCAB/2 above the prompt's last (a coin toss at first); raises in
    step ``crash_at``'s scoring."""

    crash_at: int | None
    calls: int = 0
    per_step: int = 0

    def __call__(self, *, prompt: Sequence[int], completion: Sequence[int]) -> float:
        if self.crash_at is not None and self.calls // self.per_step == self.crash_at:
            raise RuntimeError("the reward service went away")
        self.calls += 1
        return float(len(completion) > 0 and (completion[0] - prompt[-1]) % VOCAB < VOCAB // 2)


@dataclass(kw_only=True)
class _Run:
    rewards: dict[int, float] = field(default_factory=dict[int, float])
    losses: dict[int, float] = field(default_factory=dict[int, float])
    weights: dict[str, torch.Tensor] = field(default_factory=dict[str, torch.Tensor])


def _attempt(directory: Path, mesh: dict[str, int], *, crash_at: int | None, run: _Run) -> None:
    dp = max(mesh.values(), default=1)
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {
                "max_steps": STEPS,
                "global_batch_size": 8 * dp,
                "microbatch_size": 4,
                "seed": 3,
                "device": "cpu",
                "logging": {"progress_bar": False},
                "checkpoint": {"directory": str(directory), "every_steps": 2},
            },
            "optimizer": {"name": "adamw", "lr": 0.05, "weight_decay": 0.0},
        }
    )
    torch.manual_seed(99)  # the engine's weights are overwritten by the first stream
    engine = EmbeddedRolloutEngine(DecoderCausalLM(tiny_config(), attention_backend="eager"), seed=5)
    reward = _Reward(crash_at=crash_at, per_step=2 * SAMPLING.samples_per_prompt)
    rollouts = ColocatedRollouts(
        engine=engine, prompts=_prompts, reward=reward, sampling=SAMPLING, prompts_per_step=2, seed=7
    )
    provider = HFModelProvider(ScratchModelConfig(config=tiny_config(), attention_backend="eager"))
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=lambda _: GRPOTask(),
        data_provider=rollouts,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    rollouts.attach(trainer)
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda e: run.losses.__setitem__(e.step, e.loss))
        try:
            trainer.train()
        finally:
            run.rewards.update({record.step: record.mean_reward for record in rollouts.history})
        run.weights = {k: v.detach().clone() for k, v in trainer.model_stages[0].state_dict().items()}


def _uninterrupted_and_resumed(root: str, mesh: dict[str, int]) -> dict[str, Any]:
    straight, resumed = _Run(), _Run()
    _attempt(Path(root) / "straight", mesh, crash_at=None, run=straight)
    with pytest.raises(StepFailedError, match="reward service went away"):
        _attempt(Path(root) / "crashing", mesh, crash_at=CRASH_AT, run=resumed)
    assert sorted(resumed.losses) == list(range(CRASH_AT))  # steps 0-2 done, the step-2 checkpoint saved
    _attempt(Path(root) / "crashing", mesh, crash_at=None, run=resumed)  # resumes from step 2
    return {
        "rewards": (straight.rewards, resumed.rewards),
        "losses": (straight.losses, resumed.losses),
        "weights_equal": all(torch.equal(straight.weights[k], v) for k, v in resumed.weights.items()),
        "names": sorted(straight.weights) == sorted(resumed.weights),
    }


def _check(result: dict[str, Any]) -> None:
    straight_rewards, resumed_rewards = result["rewards"]
    straight_losses, resumed_losses = result["losses"]
    assert sorted(straight_rewards) == sorted(resumed_rewards) == list(range(STEPS))
    assert resumed_rewards == straight_rewards  # exact floats
    assert resumed_losses == straight_losses
    assert result["names"] and result["weights_equal"]


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    _check(_uninterrupted_and_resumed(str(tmp_path), {}))


def test_a_resumed_run_equals_the_uninterrupted_one_on_two_data_parallel_ranks(tmp_path: Path) -> None:
    # each rank samples its own rollouts: both ranks' random state must come back, not rank 0's
    results = run_distributed(
        _uninterrupted_and_resumed, str(tmp_path), {"data_parallel_shard": 2}, world_size=2, timeout_s=600
    )
    for result in results:
        _check(result)
    assert results[0]["rewards"][0] != results[1]["rewards"][0]  # the ranks drew different rollouts


def test_every_step_and_rank_samples_with_its_own_seed() -> None:
    seeds = {rollout_seed(7, step=s, dp_rank=r) for s in range(100) for r in range(8)}
    assert len(seeds) == 800
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert rollout_seed(7, step=3, dp_rank=1) == rollout_seed(7, step=3, dp_rank=1)  # a function, no state
    assert rollout_seed(8, step=3, dp_rank=1) != rollout_seed(7, step=3, dp_rank=1)


def test_a_sampling_seed_is_refused_with_the_way_to_seed_rollouts() -> None:
    with pytest.raises(ValueError, match=r"sampling.seed=1: .*ColocatedRollouts.seed"):
        ColocatedRollouts(
            engine=EmbeddedRolloutEngine(DecoderCausalLM(tiny_config(), attention_backend="eager")),
            prompts=_prompts,
            reward=_Reward(crash_at=None, per_step=1),
            sampling=SAMPLING.model_copy(update={"seed": 1}),
            prompts_per_step=2,
        )
