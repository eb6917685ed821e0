"""The pooled load-balancing loss under pipeline and expert parallelism equals one process's.

A tiny Qwen3-MoE whose config.json sets ``output_router_logits`` (so the loss is in the
objective) with a large ``router_aux_loss_coef``, trained 2 steps on 2 ranks and in one process:

- pipeline parallelism (2 stages) hands the routing statistics on with the activations, so the
  last stage pools every layer's: the same microbatches give the same losses and gradients;
- expert (= data) parallelism: each rank routes its own rows, and the statistics are summed over
  the data-parallel ranks, so the loss is the one of the global microbatch, as one process
  computes it on the whole batch (transformers' ``load_balancing_loss_func`` on that batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.hf import HFModelProvider, PretrainedModelConfig, TokenBatch, TokenSample, causal_lm_task
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ForwardBackwardFinished,
    OptimizerStepFinished,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed

SEQ, ROWS, STEPS = 12, 4, 2


class _Rows:
    def __init__(self) -> None:
        self.ids = torch.randint(1, 128, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> TokenSample:
        return TokenSample(input_ids=self.ids[index], labels=self.ids[index].clone())


def _train(directory: Path, mesh: dict[str, int], microbatch_size: int) -> dict[str, Any]:
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {
                "max_steps": STEPS,
                "global_batch_size": ROWS,
                "microbatch_size": microbatch_size,
                "logging": {"progress_bar": False},
                "device": "cpu",
            },
            "data": {"shuffle": False},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        }
    )
    losses: list[float] = []
    grad_norms: list[float] = []
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(
            PretrainedModelConfig(source=str(directory), attention_backend="eager")
        ),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.events.subscribe(OptimizerStepFinished, lambda event: grad_norms.append(event.grad_norm))
        trainer.train()
    return {"losses": losses, "grad_norms": grad_norms}


@pytest.fixture(scope="module")
def moe_aux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=2.0,  # large, so the pooling shows in the gradients
        output_router_logits=True,
    )
    directory = tmp_path_factory.mktemp("lb") / "moe_aux"
    Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    ("mesh", "world_size", "microbatch_size", "reference_microbatch_size"),
    [
        # 2 microbatches of 2 rows through 2 stages = one process accumulating the same 2
        pytest.param({"pipeline_parallel": 2}, 2, 2, 2, id="pp"),
        # 2 rows per rank, statistics summed over the 2 ranks = one process on all 4 rows
        pytest.param({"expert_parallel": 2, "data_parallel_shard": 2}, 2, 2, 4, id="ep"),
    ],
)
def test_pooled_load_balancing_loss_matches_one_process(
    moe_aux: Path, mesh: dict[str, int], world_size: int, microbatch_size: int, reference_microbatch_size: int
) -> None:
    expected = run_distributed(_train, moe_aux, {}, reference_microbatch_size, world_size=1, timeout_s=180)[0]
    results = run_distributed(_train, moe_aux, mesh, microbatch_size, world_size=world_size, timeout_s=180)
    assert len(expected["losses"]) == STEPS
    for result in results:
        torch.testing.assert_close(result["losses"], expected["losses"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(result["grad_norms"], expected["grad_norms"], atol=1e-5, rtol=1e-5)


class _AllReduces(TorchDispatchMode):
    """Counts the all-reduces the dispatcher sees (gloo's ``c10d.allreduce_`` on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func.overloadpacket).startswith("c10d.allreduce"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _all_reduces_of_one_microbatch(directory: Path) -> tuple[int, int]:
    import torch.distributed as dist

    import d9d.hf

    model = d9d.hf.load_pretrained(directory).train()
    assert isinstance(model, d9d.hf.DecoderModel) and model.spec.load_balancing
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    model.set_load_balancing_groups((group,))
    ids = torch.randint(1, 128, (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    inputs = d9d.hf.DecoderInputs(input_ids=ids, labels=d9d.hf.causal_lm_targets(ids), summed_losses=True)
    with _AllReduces() as forward:
        losses = model(inputs)
    assert isinstance(losses, torch.Tensor)
    with _AllReduces() as backward:
        losses.sum().backward()
    return forward.count, backward.count


def test_the_statistics_of_every_layer_are_summed_over_ranks_in_one_all_reduce(moe_aux: Path) -> None:
    # Two sparse layers, one microbatch: the layers' statistics ride in one hand-off tensor, so the
    # last stage sums them over the data-parallel ranks once in forward and once in backward.
    counts = run_distributed(_all_reduces_of_one_microbatch, moe_aux, world_size=2, timeout_s=120)
    assert counts == [(1, 1), (1, 1)]
