"""The model's shape for d9d-loop's memory estimate, from config.json alone (no weights fetched)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import assert_never, cast

import huggingface_hub
import torch
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from torch import nn

from d9d.hf._decoder import DecoderFamily, DecoderLayer, read_config_file
from d9d.hf._families import DECODER_CONFIG_ADAPTER, SUPPORTED_MODEL_TYPES, AnyDecoderConfig
from d9d.hf._model_config import HFModelConfig, PretrainedModelConfig, ScratchModelConfig
from d9d.kernels import linear_cross_entropy_chunk_tokens
from d9d.kernels.layers import MoELayer, SwiGLU
from d9d.loop.estimate import LinearShape, ModelMemoryShape

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LAYER = "model.layers.{layer}."


def _config_directory(source: str, revision: str | None) -> Path:
    path = Path(source)
    if path.is_dir():
        return path
    try:
        fetched = huggingface_hub.hf_hub_download(repo_id=source, filename="config.json", revision=revision)
    except (LocalEntryNotFoundError, HfHubHTTPError, ValueError) as e:
        raise FileNotFoundError(
            f"{source}: config.json cannot be read (a local directory or a Hub repo id): {e}"
        ) from None
    return Path(fetched).parent


def family_config(config: HFModelConfig) -> AnyDecoderConfig:
    """The config.json the model is built from: the source's (only that file) or ``model.config``."""
    match config:
        case PretrainedModelConfig():
            directory = _config_directory(config.source, config.revision)
            what = "model_type " + "/".join(SUPPORTED_MODEL_TYPES)
            return read_config_file(directory, DECODER_CONFIG_ADAPTER, what=what)
        case ScratchModelConfig():
            return config.config


@dataclass(kw_only=True, frozen=True)
class _LayerShape:
    """One decoder layer as the estimate states it."""

    linears: tuple[LinearShape, ...]
    other: int
    ffn_width: int
    experts_per_token: int

    @property
    def numel(self) -> int:
        return sum(linear.numel for linear in self.linears) + self.other


def _feed_forward(mlp: SwiGLU | MoELayer) -> tuple[int, int]:
    """The feed-forward width each token runs through, and its routed experts per token."""
    match mlp:
        case SwiGLU():
            return mlp.gate_proj.out_features, 0
        case MoELayer():
            shared = 0 if mlp.shared_expert is None else mlp.shared_expert.gate_proj.out_features
            return mlp.top_k * mlp.experts.intermediate_size + shared, mlp.top_k
        case _:
            assert_never(mlp)


def _layer_shape(layer: DecoderLayer) -> _LayerShape:
    """``layer``'s parameters: ``nn.Linear`` weights and stacked ``(experts, in, out)`` weights
    as linears under their qualified names, every other element (norms, biases, router) counted."""
    linears: list[LinearShape] = []
    stated: set[str] = set()
    for name, module in cast(Iterator[tuple[str, nn.Module]], layer.named_modules()):
        if isinstance(module, nn.Linear):
            linears.append(
                LinearShape(
                    name=_LAYER + name, in_features=module.in_features, out_features=module.out_features
                )
            )
            stated.add(f"{name}.weight")
    other = 0
    for name, parameter in layer.named_parameters():
        if name in stated:
            continue
        if parameter.dim() == 3:
            experts, in_features, out_features = parameter.shape
            linears.append(
                LinearShape(
                    name=_LAYER + name,
                    in_features=in_features,
                    out_features=out_features,
                    count=experts,
                    expert=True,
                )
            )
        else:
            other += parameter.numel()
    ffn_width, experts_per_token = _feed_forward(layer.mlp)
    return _LayerShape(
        linears=tuple(linears), other=other, ffn_width=ffn_width, experts_per_token=experts_per_token
    )


def _layer_shapes(family: DecoderFamily, num_layers: int) -> list[_LayerShape]:
    """Every distinct layer of ``family``, each built on the meta device (no memory, no init cost)."""
    shapes: list[_LayerShape] = []
    with torch.device("meta"):
        for index in range(num_layers):
            shape = _layer_shape(family.build_decoder_layer(index, attention_backend=None))
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def memory_shape(config: HFModelConfig, family: DecoderFamily) -> ModelMemoryShape:
    """The estimate's statement of the model of ``config`` (a causal LM head, or a tied one).

    Each decoder layer is built on the meta device from the family and its parameters read:
    ``nn.Linear`` weights and stacked ``(experts, in, out)`` expert weights are the layer's
    linears (named ``model.layers.{layer}.<qualified name>``, as LoRA's ``target`` sees them),
    every other element (norms, biases, router) is counted; the feed-forward width and experts
    per token are the layer's ``mlp``'s. ``ModelMemoryShape`` states one layer for all: when
    layers differ (Qwen3-MoE's dense ``mlp_only_layers``), every layer is stated as the one with
    the most parameters, with the widest feed-forward and the most experts per token of any
    layer, an upper bound.
    """
    spec = family.decoder_spec()
    layers = _layer_shapes(family, spec.num_layers)
    largest = max(layers, key=lambda layer: layer.numel)
    storage = _BYTES[config.master_dtype]
    compute = _BYTES[config.compute_dtype] if config.compute_dtype is not None else storage
    return ModelMemoryShape(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        ffn_width=max(layer.ffn_width for layer in layers),
        experts_per_token=max(layer.experts_per_token for layer in layers),
        layer_linears=largest.linears,
        layer_other_parameters=largest.other,
        head=None
        if spec.tie_word_embeddings
        else LinearShape(name="lm_head", in_features=spec.hidden_size, out_features=spec.vocab_size),
        other_parameters=spec.hidden_size,
        storage_bytes=storage,
        compute_bytes=compute,
        activation_checkpointing=config.activation_checkpointing,
        last_stage_weight=config.last_stage_weight,
        head_chunk_tokens=partial(linear_cross_entropy_chunk_tokens, element_size=compute),
    )
