"""Tiny Hugging Face checkpoints written by transformers, and helpers comparing d9d to them."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from d9d.hf import DecoderModel
from d9d.hf._decoder import export_mapper_of
from d9d.state_mappers import map_state_dict

# torch imports its compiler stack lazily, on the first DTensor call; once here, before ranks fork.
torch.compiler.disable(lambda: None)()

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def _save(model: Any, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> directory of a random tiny checkpoint saved by transformers."""
    from transformers import (
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dense = Qwen3Config(
        **TINY,
        num_hidden_layers=3,
        # YaRN with its attention factor; sliding windows on layers 1 and 2; q/k/v/o biases
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        attention_bias=True,
        pad_token_id=0,
    )
    tied = Qwen3Config(**TINY, num_hidden_layers=2, tie_word_embeddings=True)
    moe = Qwen3MoeConfig(
        **TINY,
        num_hidden_layers=4,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[2],  # layers 0, 1, 3 sparse, layer 2 dense
        router_aux_loss_coef=0.05,
    )
    # the same MoE model whose config.json asks for the load-balancing loss in the objective
    moe_aux = Qwen3MoeConfig.from_dict({**moe.to_dict(), "output_router_logits": True})
    classifier = Qwen3Config(**TINY, num_hidden_layers=2, num_labels=3, pad_token_id=0)

    def init(model: nn.Module) -> nn.Module:
        with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor shows
            for name, parameter in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
        return model

    return {
        "dense": _save(init(Qwen3ForCausalLM(dense)), root / "dense"),
        "tied": _save(init(Qwen3ForCausalLM(tied)), root / "tied"),
        "moe": _save(init(Qwen3MoeForCausalLM(moe)), root / "moe"),
        "moe_aux": _save(init(Qwen3MoeForCausalLM(moe_aux)), root / "moe_aux"),
        "classifier": _save(init(Qwen3ForSequenceClassification(classifier)), root / "classifier"),
    }


def hf_model(directory: Path, kind: str = "causal_lm") -> nn.Module:
    """transformers' model of a checkpoint, fp32, eager attention."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
    return auto.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)


def hf_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """transformers' gradients in checkpoint names (its fused experts split per expert)."""
    out: dict[str, torch.Tensor] = {}
    fused_on_disk = getattr(model.config, "model_type", None) == "gpt_oss"  # its checkpoint's names
    for name, parameter in model.named_parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        if fused_on_disk:
            out[name] = grad
        elif name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            half = grad.shape[1] // 2
            for e in range(grad.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = grad[e, :half]
                out[f"{base}{e}.up_proj.weight"] = grad[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(grad.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = grad[e]
        else:
            out[name] = grad
    parameters = dict(model.named_parameters(remove_duplicate=False))  # a tied head too
    for name, buffer in model.state_dict().items():  # a checkpoint buffer (DeepSeek-V3's selection bias)
        if name not in parameters:
            out[name] = torch.zeros_like(buffer)  # no gradient, as d9d_gradients gives its buffers
    return out


def d9d_gradients(model: DecoderModel) -> dict[str, torch.Tensor]:
    """d9d's gradients mapped to checkpoint names through the export mapper."""
    grads = {
        name: t.grad if t.grad is not None else torch.zeros_like(t)
        for name, t in model.state_dict(keep_vars=True).items()
    }
    return map_state_dict(export_mapper_of(model), grads)


def assert_same_gradients(d9d: dict[str, torch.Tensor], hf: dict[str, torch.Tensor]) -> None:
    assert d9d.keys() == hf.keys()
    for name, grad in hf.items():
        torch.testing.assert_close(d9d[name], grad, atol=2e-5, rtol=1e-4, msg=f"gradient of {name}")


@pytest.fixture
def helpers() -> ModuleType:
    """This module: ``hf_model``, ``hf_gradients``, ``d9d_gradients``, ``assert_same_gradients``."""
    return sys.modules[__name__]
