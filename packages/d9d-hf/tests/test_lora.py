"""LoRA (d9d.loop.peft) on HFModelProvider: the base checkpoint loads, step 0 is the base model,
training moves the adapters, and the merged export is a plain transformers checkpoint.

Two heads: the causal LM of its checkpoint, and a fresh two-class head on the same causal-LM
checkpoint (trained in full beside the adapters), loaded back with
``AutoModelForSequenceClassification``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from d9d.hf import (
    DecoderInputs,
    DecoderModel,
    HFModelProvider,
    PretrainedModelConfig,
    TokenBatch,
    TokenSample,
    causal_lm_task,
)
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    ForwardBackwardFinished,
    ProjectConfig,
    TaskProviderContext,
    TrainingConfigurator,
    TrainTask,
)
from d9d.loop.peft import GroupedLoRAExperts, LoRALinear
from d9d.mesh.testing import run_distributed

SEQ = 12
PROBE = torch.randint(1, 128, (3, SEQ), generator=torch.Generator().manual_seed(11))  # no pad (0)
LORA = {"kind": "lora", "target": r"q_proj|v_proj|down_proj", "r": 4, "alpha": 8.0}


class _Rows:
    """16 rows of random tokens (never the pad id 0); the class is the first token's parity."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, 128, (16, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> TokenSample:
        ids = self.ids[index]
        return TokenSample(input_ids=ids, labels=ids.clone())


@dataclass(kw_only=True)
class _Classes:
    labels: torch.Tensor


class _ClassifyTask(TrainTask[TokenBatch, DecoderInputs, None, torch.Tensor, _Classes]):
    """Cross-entropy of the class logits against the first token's parity."""

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[TokenBatch]
    ) -> BuildForwardInputsResult[DecoderInputs, None, _Classes]:
        ids = ctx.batch.input_ids
        return BuildForwardInputsResult(
            input=DecoderInputs(input_ids=ids), shared=None, state=_Classes(labels=ids[:, 0] % 2)
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, _Classes]) -> ComputeLossResult:
        return ComputeLossResult(
            loss=F.cross_entropy(ctx.pipeline_results, ctx.state.labels), loss_weight=None
        )


def _classify_task(_: TaskProviderContext) -> _ClassifyTask:
    return _ClassifyTask()


def _train(
    directory: Path,
    head: str,
    peft: dict[str, Any],
    steps: int,
    export: Path | None,
    mesh: dict[str, int] | None = None,
) -> dict[str, Any]:
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh or {},
            "trainer": {
                "max_steps": steps,
                "global_batch_size": 8,
                "microbatch_size": 4,
                "logging": {"progress_bar": False},
                "device": "cpu",
                "peft": peft,
            },
            "data": {"shuffle": False},
            "optimizer": {"name": "adamw", "lr": 0.02, "weight_decay": 0.0},
        }
    )
    classify = head == "sequence_classification"
    model_config = PretrainedModelConfig.model_validate(
        {
            "source": str(directory),
            "head": head,
            "attention_backend": "eager",
            **({"num_labels": 2} if classify else {}),
        }
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model_config),
        task_provider=_classify_task if classify else causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    losses: list[float] = []
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.train()
        model = trainer.model_stages[0]
        model.eval()
        with torch.no_grad():
            if mesh:  # the probe calls the stage's methods directly, outside the TP hooks
                logits = None
            elif model.export_head == "sequence_classification":
                logits = model.classify(PROBE)
            else:
                assert isinstance(model, DecoderModel) and model.export_head == "causal_lm"
                logits = model.logits(PROBE)
        adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
        if export is not None:
            trainer.export(export)
    return {
        "losses": losses,
        "logits": logits,
        "num_adapted": len(adapters),
        "num_grouped": sum(isinstance(m, GroupedLoRAExperts) for m in model.modules()),
        "max_grouped_b": max(
            (
                float(_full(p).abs().max())
                for n, p in model.named_parameters()
                if "experts.lora_" in n and n.endswith("lora_B")
            ),
            default=0.0,
        ),
        "placements": {
            n: str(p.placements)
            for n, p in model.named_parameters()
            if isinstance(p, DTensor) and "lora" in n
        },
        "max_lora_b": max((float(m.lora_B.abs().max()) for m in adapters), default=0.0),
    }


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _run(*args: Any) -> dict[str, Any]:
    return run_distributed(_train, *args, world_size=1, timeout_s=180)[0]


@pytest.mark.parametrize(
    ("head", "extra"),
    [
        ("causal_lm", {}),  # the checkpoint's own head, adapters only
        ("sequence_classification", {"trainable": "score"}),  # a fresh head, trained in full
    ],
)
def test_lora_loads_the_base_checkpoint_trains_and_exports_a_merged_model(
    checkpoints: dict[str, Path], tmp_path: Path, helpers: Any, head: str, extra: dict[str, Any]
) -> None:
    directory = checkpoints["dense"]  # a causal-LM checkpoint: a classifier head starts fresh
    base = _run(directory, head, {"kind": "full"}, 1, None)
    export = tmp_path / "export"
    lora = _run(directory, head, {**LORA, **extra}, 4, export)

    # 3 layers x (q, v, down); B = 0 at step 0, a fresh head drawn alike: the base model's loss
    assert lora["num_adapted"] == 9
    torch.testing.assert_close(lora["losses"][0], base["losses"][0], atol=1e-6, rtol=1e-6)
    assert all(torch.isfinite(torch.tensor(lora["losses"])))
    assert lora["max_lora_b"] > 0  # the adapters trained, so the merge changes the weights

    hf = helpers.hf_model(export, head)
    with torch.no_grad():
        hf_logits = hf(PROBE).logits
    torch.testing.assert_close(hf_logits, lora["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mesh", [{"tensor_parallel": 2}, {"tensor_parallel": 2, "data_parallel_shard": 2}])
def test_lora_under_tensor_parallelism_matches_one_process(
    checkpoints: dict[str, Path], mesh: dict[str, int]
) -> None:
    # q/v column-parallel (A replicated, B split by rows), down row-parallel (A split by columns)
    directory = checkpoints["dense"]
    single = _run(directory, "causal_lm", LORA, 2, None)
    world = 2 * mesh.get("data_parallel_shard", 1)
    for result in run_distributed(
        _train, directory, "causal_lm", LORA, 2, None, mesh, world_size=world, timeout_s=180
    ):
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(single["losses"]), atol=1e-5, rtol=1e-5
        )
        assert result["num_adapted"] == 9
        if world > 2:  # under FSDP too the adapters train to the same losses
            continue
        placements = result["placements"]
        assert placements["model.layers.0.self_attn.q_proj.lora_A"] == str((Replicate(),))
        assert placements["model.layers.0.self_attn.q_proj.lora_B"] == str((Shard(0),))
        assert placements["model.layers.0.mlp.down_proj.lora_A"] == str((Shard(1),))
        assert placements["model.layers.0.mlp.down_proj.lora_B"] == str((Replicate(),))


MOE_LORA = {"kind": "lora", "target": r"experts|q_proj", "r": 2, "alpha": 4.0}


def test_grouped_lora_on_moe_experts_exports_merged_and_matches_under_expert_parallelism(
    checkpoints: dict[str, Path], tmp_path: Path, helpers: Any
) -> None:
    directory = checkpoints["moe"]
    base = _run(directory, "causal_lm", {"kind": "full"}, 1, None)
    export = tmp_path / "export"
    single = _run(directory, "causal_lm", MOE_LORA, 2, export)
    # every MoE layer's experts got per-expert adapters, and they trained
    assert single["num_grouped"] > 0 and single["max_grouped_b"] > 0
    torch.testing.assert_close(single["losses"][0], base["losses"][0], atol=1e-6, rtol=1e-6)
    hf = helpers.hf_model(export, "causal_lm")
    with torch.no_grad():
        torch.testing.assert_close(hf(PROBE).logits, single["logits"], atol=1e-4, rtol=1e-4)
    mesh = {"expert_parallel": 2, "data_parallel_shard": 2}
    for result in run_distributed(
        _train, directory, "causal_lm", MOE_LORA, 2, None, mesh, world_size=2, timeout_s=180
    ):
        assert result["num_grouped"] == single["num_grouped"]
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(single["losses"]), atol=1e-5, rtol=1e-5
        )
