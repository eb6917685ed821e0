"""``d9d export`` of a checkpoint saved under pipeline parallel 2 x fully sharded 2 gives the job's model.

A tiny Qwen3 trains 2 steps on 4 CPU ranks and saves a DCP checkpoint, and the job exports itself
with ``Trainer.export``; then the ``d9d export`` command, in its own process, turns the checkpoint
into a Hugging Face directory from the job's YAML alone. transformers loads both and gives the
same logits; every tensor is equal. The command runs as ``python -m d9d.loop.cli`` would, in a
process forked by the session's script runner (see script_runner), which imported torch and d9d
once instead of once per command.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from script_runner import run_module

from d9d.hf import HFModelProvider, PretrainedModelConfig, TokenBatch, TokenSample, causal_lm_task
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed

SEQ = 16
# What the command imports before it reads its arguments: imported once in the session's runner.
CLI_IMPORTS = ("d9d.loop", "d9d.hf", "d9d.loop.cli._commands", "d9d.loop.cli._checkpoint_export")


class _Rows:
    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (16, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> TokenSample:
        return TokenSample(input_ids=self.ids[index], labels=self.ids[index].clone())


def _raw_config(source: Path, checkpoints: Path) -> dict[str, Any]:
    return {
        "mesh": {"pipeline_parallel": 2, "data_parallel_shard": 2},
        "model": {"source": str(source), "attention_backend": "eager"},
        "trainer": {
            "max_steps": 2,
            "global_batch_size": 8,
            "microbatch_size": 2,
            "device": "cpu",
            "logging": {"progress_bar": False},
            "checkpoint": {"directory": str(checkpoints), "every_steps": 2},
        },
        "data": {"shuffle": False},
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
    }


def _train(raw: dict[str, Any], export: str) -> None:
    config = ProjectConfig.model_validate({k: v for k, v in raw.items() if k != "model"})
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(PretrainedModelConfig.model_validate(raw["model"])),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer:
        trainer.train()
        trainer.export(export)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


@pytest.mark.slow
def test_d9d_export_of_a_pp2_x_fsdp2_checkpoint_equals_the_jobs_own_export(
    tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    source = tmp_path / "tiny"
    tiny = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=4, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen3ForCausalLM(tiny).save_pretrained(source)
    raw = _raw_config(source, tmp_path / "ckpt")
    run_distributed(_train, raw, str(tmp_path / "trainer-export"), world_size=4, timeout_s=240)

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    arguments = ["export", str(config), str(tmp_path / "ckpt"), str(tmp_path / "cli")]
    result = run_module(
        torch_runner, "d9d.loop.cli", *arguments, cwd=tmp_path, timeout_s=240, preload=CLI_IMPORTS
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step_000000002" in result.stdout

    ours, theirs = _tensors(tmp_path / "cli"), _tensors(tmp_path / "trainer-export")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(
        theirs["model.norm.weight"], load_file(source / "model.safetensors")["model.norm.weight"]
    )

    probe = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))
    logits = []
    for directory in (tmp_path / "cli", tmp_path / "trainer-export"):
        model = AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="eager", dtype=torch.float32
        )
        with torch.no_grad():
            logits.append(model(probe).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@pytest.mark.slow
def test_d9d_export_refuses_a_config_of_another_family_naming_the_tensors_it_lacks(
    tmp_path: Path, torch_runner: subprocess.Popen[str]
) -> None:
    # Issue 42: a Llama config of the same widths on a Qwen3 checkpoint exported a Llama without
    # Qwen3's q/k norms (logits off by 0.52) and exited 0.
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    widths: dict[str, Any] = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "tie_word_embeddings": False,
    }  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**widths)).save_pretrained(tmp_path / "qwen3")
    LlamaForCausalLM(LlamaConfig(**widths)).save_pretrained(tmp_path / "llama")
    raw = _raw_config(tmp_path / "qwen3", tmp_path / "ckpt")
    raw["mesh"] = {}
    run_distributed(_train, raw, str(tmp_path / "trainer-export"), world_size=1, timeout_s=240)

    raw["model"]["source"] = str(tmp_path / "llama")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    arguments = ["export", str(config), str(tmp_path / "ckpt"), str(tmp_path / "out")]
    result = run_module(
        torch_runner, "d9d.loop.cli", *arguments, cwd=tmp_path, timeout_s=240, preload=CLI_IMPORTS
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "q_norm" in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "out").exists()
