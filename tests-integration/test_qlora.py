"""LoRA on a 4-bit NF4 base (d9d-loop's ``peft.base: {kind: nf4}``) through d9d-hf: a tiny Qwen3
trains on it, its merged export is a plain transformers checkpoint whose logits are the d9d
model's, and FP8 on top of the 4-bit base is refused before the base is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.hf import HFModelProvider, PretrainedModelConfig, TokenBatch, TokenSample, causal_lm_task
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ForwardBackwardFinished,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.loop.peft import LoRALinear, NF4Weight
from d9d.mesh.testing import run_distributed

pytest.importorskip("bitsandbytes", reason="bitsandbytes (d9d-loop's quant extra) is not installed")

SEQ = 12
PROBE = torch.randint(1, 128, (3, SEQ), generator=torch.Generator().manual_seed(11))
QLORA = {
    "kind": "lora",
    "target": "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj",
    "r": 4,
    "alpha": 8.0,
    "base": {"kind": "nf4"},
}


class _Rows:
    def __init__(self) -> None:
        self.ids = torch.randint(1, 128, (16, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> TokenSample:
        return TokenSample(input_ids=self.ids[index], labels=self.ids[index].clone())


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    directory = tmp_path_factory.mktemp("qwen3") / "tiny"
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def _train(directory: Path, options: dict[str, Any], export: Path | None) -> dict[str, Any]:
    config = ProjectConfig.model_validate(
        {
            "trainer": {
                "max_steps": 4,
                "global_batch_size": 8,
                "microbatch_size": 4,
                "logging": {"progress_bar": False},
                "device": "cpu",
                "peft": QLORA,
            },
            "data": {"shuffle": False},
            "optimizer": {"name": "adamw", "lr": 0.02, "weight_decay": 0.0},
        }
    )
    model_config = PretrainedModelConfig.model_validate(
        {"source": str(directory), "attention_backend": "eager", **options}
    )
    losses: list[float] = []
    with TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(model_config),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure() as trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.train()
        model: Any = trainer.model_stages[0]
        model.eval()
        with torch.no_grad():
            logits = model.logits(PROBE)
        layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
        if export is not None:
            trainer.export(export)
    return {
        "losses": losses,
        "logits": logits,
        "quantized": sum(isinstance(m.quantized, NF4Weight) for m in layers),
        "layers": len(layers),
        "max_lora_b": max(float(m.lora_B.abs().max()) for m in layers),
    }


def test_a_tiny_qwen3_trains_on_a_4bit_base_and_exports_a_merged_model_transformers_loads(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    export = tmp_path / "export"
    options = {"param_dtype": "float32"}  # one process: no FSDP unit, the weights stay plain tensors
    result = run_distributed(_train, tiny_qwen3, options, export, world_size=1, timeout_s=180)[0]
    assert result["layers"] == result["quantized"] == 2 * 7  # every projection of both layers is NF4
    assert result["max_lora_b"] > 0 and all(torch.isfinite(torch.tensor(result["losses"])))

    merged = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(PROBE).logits, result["logits"], atol=1e-4, rtol=1e-4)
        # and the 4-bit base was not the bf16 one: the original model's logits differ
        original = AutoModelForCausalLM.from_pretrained(tiny_qwen3, attn_implementation="eager")
        assert (original(PROBE).logits - result["logits"]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # FP8 replaces the base product the 4-bit weight computes
        (
            {
                "param_dtype": "bfloat16",
                "float8": {"recipe": "tensorwise", "emulate": True, "min_features": 16},  # tiny widths
            },
            r"cannot be combined with FP8 \(model.float8\): layer 'model\.",
        ),
        # float32 masters cast for bf16 compute under recompute: one FSDP unit wraps the stage
        (
            {"param_dtype": "bfloat16", "activation_checkpointing": True},
            r"layer 'model\..*' was sharded by the model provider .* model.master_dtype: bfloat16",
        ),
    ],
)
def test_what_the_4bit_base_cannot_serve_in_d9d_hf_is_refused_before_loading(
    tiny_qwen3: Path, options: dict[str, Any], message: str
) -> None:
    if "float8" in options:
        pytest.importorskip("torchao.float8", reason="torchao (the float8 extra) is not installed")
    with pytest.raises(ValueError, match=message):
        _train(tiny_qwen3, options, None)
