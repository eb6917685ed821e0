"""MXFP4 GPT-OSS checkpoints: experts dequantized at load as transformers does, malformed pairs refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import d9d.hf
from d9d.hf._decoder._mxfp4 import E2M1_VALUES, dequantize_mxfp4
from d9d.hf._decoder._quantized_tensors import Mxfp4Mapper
from d9d.mesh.testing import run_distributed
from d9d.state_mappers import SafetensorsCheckpoint, TensorPiece, TensorSpec

TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 32,  # MXFP4 blocks span 32 input values
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 3,
}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
PROBE = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``(E, in, out)`` expert weight as MXFP4 blocks and scales, each value the nearest code."""
    rows = weight.float().transpose(1, 2)
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2**-30) / 6.0))
    magnitudes = torch.tensor(E2M1_VALUES)
    table = torch.cat([magnitudes, -magnitudes])
    codes = ((groups / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1) - table).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny GPT-OSS twice: experts as MXFP4 pairs, and as transformers dequantizes them (bf16)."""
    from transformers import GptOssConfig as HFGptOssConfig
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    model = GptOssForCausalLM(HFGptOssConfig(**TINY))
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model.save_pretrained(root / "source")
    config = json.loads((root / "source" / "config.json").read_text())
    tensors = load_file(root / "source" / "model.safetensors")
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        blocks, scales = _quantize(tensors[name].normal_(std=0.5))
        del quantized[name]
        quantized |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        dequantized[name] = convert_moe_packed_tensors(blocks, scales)
    return {
        "mxfp4": _write(root / "mxfp4", quantized, {**config, "quantization_config": MXFP4}),
        "bf16": _write(root / "bf16", dequantized, config),
    }


def test_dequantizer_equals_transformers_bit_for_bit() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (3, 10, 2), dtype=torch.uint8, generator=generator)  # every exponent
    expected = convert_moe_packed_tensors(blocks, scales)
    for chunk in (1, 2, 3):
        out = dequantize_mxfp4(blocks, scales, chunk=chunk)
        assert out.shape == expected.shape == (3, 64, 10) and out.dtype == torch.bfloat16
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_mxfp4_checkpoint_loads_as_its_dequantized_twin_and_exports_plain(
    checkpoints: dict[str, Path], tmp_path: Path, helpers: Any
) -> None:
    quantized = d9d.hf.load_pretrained(checkpoints["mxfp4"]).eval()
    plain = d9d.hf.load_pretrained(checkpoints["bf16"]).eval()
    d9d.hf.save_pretrained(quantized, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert not [name for name in SafetensorsCheckpoint(tmp_path / "out").specs if name.endswith("_blocks")]
    with torch.no_grad():
        logits = quantized.logits(PROBE)
        torch.testing.assert_close(logits, plain.logits(PROBE), atol=0, rtol=0)
        hf = helpers.hf_model(checkpoints["bf16"]).eval()
        torch.testing.assert_close(logits, hf(PROBE).logits, atol=1e-4, rtol=1e-4)
        exported = helpers.hf_model(tmp_path / "out").eval()  # transformers reads it as a plain model
        torch.testing.assert_close(exported(PROBE).logits, hf(PROBE).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, n: t.pop(f"{n}_scales"), r"'{n}_blocks' is half of an MXFP4 pair whose '{n}_scales'"),
        (
            lambda t, n: t.update({f"{n}_scales": t[f"{n}_scales"][:, :-1].contiguous()}),
            r"'{n}_blocks' .* and '{n}_scales' .* are not an MXFP4 pair",
        ),
    ],
)
def test_a_malformed_pair_is_refused_naming_the_file_and_tensor(
    checkpoints: dict[str, Path], tmp_path: Path, edit: Any, message: str
) -> None:
    name = "model.layers.1.mlp.experts.down_proj"
    tensors = load_file(checkpoints["mxfp4"] / "model.safetensors")
    edit(tensors, name)
    config = json.loads((checkpoints["mxfp4"] / "config.json").read_text())
    directory = _write(tmp_path / "bad", tensors, config)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor " + message.format(n=name)):
        d9d.hf.load_pretrained(directory)


def test_a_slice_of_the_experts_reads_only_those_experts() -> None:
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (4, 6, 2, 16), dtype=torch.uint8, generator=generator)
    scales = (
        torch.randint(120, 130, (4, 6), dtype=torch.uint8, generator=generator).unsqueeze(-1).repeat(1, 1, 2)
    )
    specs = {"w_blocks": TensorSpec.of(blocks), "w_scales": TensorSpec.of(scales)}
    mapper = Mxfp4Mapper("w")
    assert mapper.infer(specs) == {"w": TensorSpec(shape=(4, 64, 6), dtype=torch.bfloat16)}
    box = ((1, 3), (8, 40), (2, 5))  # an expert-parallel rank's experts, a slice of them
    plan = mapper.plan(specs, {"w": box})
    assert plan.input_boxes == {
        "w_blocks": ((1, 3), (0, 6), (0, 2), (0, 16)),
        "w_scales": ((1, 3), (0, 6), (0, 2)),
    }
    pieces = {
        name: TensorPiece(data=t[1:3], box=plan.input_boxes[name])
        for name, t in (("w_blocks", blocks), ("w_scales", scales))
    }
    assert torch.equal(plan.run(pieces)["w"], dequantize_mxfp4(blocks, scales)[1:3, 8:40, 2:5])


def _train_expert_parallel(directory: Path, mesh: dict[str, int]) -> list[float]:
    """Two steps under ``mesh`` (fp32, eager attention): the losses."""
    from d9d.hf import HFModelProvider, PretrainedModelConfig, TokenBatch, TokenSample, causal_lm_task
    from d9d.loop import (
        AutoDataProvider,
        AutoLRSchedulerProvider,
        AutoOptimizerProvider,
        ForwardBackwardFinished,
        ProjectConfig,
        TrainingConfigurator,
    )

    rows = [TokenSample(input_ids=ids, labels=ids.clone()) for ids in PROBE.repeat(2, 1)]
    trainer_config = {"max_steps": 2, "global_batch_size": 4, "microbatch_size": 2, "device": "cpu"}
    config = ProjectConfig.model_validate(
        {
            "mesh": mesh,
            "trainer": {**trainer_config, "logging": {"progress_bar": False}},
            "data": {"shuffle": False},
            "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        }
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(
            PretrainedModelConfig(source=str(directory), attention_backend="eager")
        ),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: rows, collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    losses: list[float] = []
    with trainer:
        trainer.events.subscribe(ForwardBackwardFinished, lambda event: losses.append(event.loss))
        trainer.train()
    return losses


def test_expert_parallel_ranks_load_their_mxfp4_experts(checkpoints: dict[str, Path]) -> None:
    mesh = {"expert_parallel": 2, "data_parallel_shard": 2}
    quantized = run_distributed(
        _train_expert_parallel, checkpoints["mxfp4"], mesh, world_size=2, timeout_s=180
    )
    plain = run_distributed(_train_expert_parallel, checkpoints["bf16"], {}, world_size=1, timeout_s=180)[0]
    assert len(plain) >= 2 and len(quantized) == 2
    for losses in quantized:  # each rank loads the slice of experts it holds
        torch.testing.assert_close(losses, plain, atol=2e-5, rtol=2e-5)
