"""GRPO with a reference model inside a d9d-loop run: built beside the policy, laid out like it.

The reference is the policy's starting point, so the KL of the first step (the policy not yet
updated) is zero and later steps move away from it; its log-probs on FSDP ranks equal one
process's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rl_tiny_model import VOCAB, tiny_config
from torch.distributed.tensor import DTensor

from d9d.hf import DecoderCausalLM, HFModelProvider, ScratchModelConfig
from d9d.loop import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed
from d9d.rl import (
    ColocatedRollouts,
    Completion,
    EmbeddedRolloutEngine,
    GRPOLossConfig,
    GRPOTask,
    ReferenceModel,
    RolloutBatch,
    SamplingParams,
)

SAMPLING = SamplingParams(samples_per_prompt=4, max_tokens=3, temperature=1.0)


def _prompts(*, step: int, dp_rank: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return [[int(t) for t in torch.randint(2, VOCAB, (3,), generator=generator)] for _ in range(count)]


def _reward(*, prompt: Sequence[int], completion: Sequence[int]) -> float:
    return float(len(completion) > 0 and (completion[0] - prompt[-1]) % VOCAB < VOCAB // 2)


def _fixed_batch() -> RolloutBatch:
    """The same rows on every rank, to compare the reference across layouts."""
    completions = [
        Completion(prompt_index=0, token_ids=[5, 9, 1], log_probs=torch.zeros(3), finish_reason="length"),
        Completion(prompt_index=1, token_ids=[7], log_probs=torch.zeros(1), finish_reason="stop"),
    ]
    return RolloutBatch.from_completions([[3, 4, 8], [12, 2]], completions, torch.zeros(2))


def _run(mesh: dict[str, int]) -> dict[str, Any]:
    dp = max(mesh.values(), default=1)
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {
                "max_steps": 2,
                "global_batch_size": 8 * dp,
                "microbatch_size": 4,
                "seed": 3,
                "device": "cpu",
                "logging": {"progress_bar": False},
            },
            "optimizer": {"name": "adamw", "lr": 0.05, "weight_decay": 0.0},
        }
    )
    provider = HFModelProvider(ScratchModelConfig(config=tiny_config(), attention_backend="eager"))
    reference = ReferenceModel(provider)
    torch.manual_seed(99)  # the engine's weights are overwritten by the first stream
    rollouts = ColocatedRollouts(
        engine=EmbeddedRolloutEngine(DecoderCausalLM(tiny_config(), attention_backend="eager"), seed=5),
        prompts=_prompts,
        reward=_reward,
        sampling=SAMPLING,
        prompts_per_step=2,
        seed=7,
        reference=reference,
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=lambda _: GRPOTask(GRPOLossConfig(kl_coefficient=0.5), reference=reference),
        data_provider=rollouts,
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    rollouts.attach(trainer)
    fixed = _fixed_batch()
    policy = trainer.model_stages[0]
    with torch.no_grad():
        initial = -policy(fixed.decoder_inputs(), None).float().masked_fill(fixed.targets == -100, 0.0)
    kl: dict[int, float] = {}
    with trainer:
        trainer.events.subscribe(StepFinished, lambda e: kl.__setitem__(e.step, e.metrics["kl"]))
        trainer.train()
    after = reference.log_probs(fixed.decoder_inputs())
    placements = {
        name: (tuple(p.placements), tuple(q.placements))
        for (name, p), (_, q) in zip(
            reference.module.named_parameters(), policy.named_parameters(), strict=True
        )
        if isinstance(p, DTensor) and isinstance(q, DTensor)
    }
    return {
        "kl": kl,
        "initial": initial,
        "reference": after,
        "placements": placements,
        "offloaded": reference.is_offloaded,
        "frozen": not any(p.requires_grad for p in reference.module.parameters()),
    }


def test_the_reference_is_the_policys_start_sharded_like_it_and_the_kl_grows_from_zero() -> None:
    single = _run({})
    assert single["offloaded"] and single["frozen"]
    # the reference's values are the policy's initial ones (the trainer has trained since)
    torch.testing.assert_close(single["reference"], single["initial"], atol=1e-6, rtol=0)
    kl = single["kl"]
    assert sorted(kl) == [0, 1]
    assert abs(kl[0]) < 1e-9  # step 0 trains the initial policy: k3 of equal log-probs
    assert kl[1] > 1e-6

    sharded = run_distributed(_run, {"data_parallel_shard": 2}, world_size=2, timeout_s=600)
    for rank, result in enumerate(sharded):
        assert result["offloaded"] and result["frozen"], rank
        assert result["placements"], rank  # the reference is sharded like the policy ...
        for name, (ours, policys) in result["placements"].items():
            assert ours == policys, (rank, name)
        # ... and computes one process's values
        torch.testing.assert_close(result["reference"], single["reference"], atol=1e-6, rtol=1e-6)
        assert abs(result["kl"][0]) < 1e-9 and result["kl"][1] > 1e-6
