"""The core builds every family's layer from a ``LayerRecipe``: each switch and norm layout equals its
plain-PyTorch composition, and norms that do not fit a layout are refused naming both."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from d9d.hf import DecoderLayer, LayerRecipe, NormLayout, build_layer
from d9d.kernels.layers import RMSNorm, RotaryEmbedding

_RECIPE = LayerRecipe(
    hidden_size=16,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    intermediate_size=24,
    norm_eps=1e-6,
    init_std=0.02,
)


def _inputs() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 16)
    return hidden, RotaryEmbedding(4, theta=10000.0)(torch.arange(5)[None].expand(2, 5))


def _reference(layer: DecoderLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The layer's computation from its modules, written out per layout."""
    scale = layer.residual_multiplier

    def attend(h: torch.Tensor) -> torch.Tensor:
        return layer.self_attn(h, rope, document_ids=None)

    norm_in, post_attn = layer.input_layernorm, layer.post_attention_layernorm
    pre_ff, post_ff = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
    match layer.norm_layout:
        case "pre":
            assert norm_in is not None
            x = x + scale * attend(norm_in(x))
            return x + scale * layer.mlp(post_attn(x))
        case "post":
            assert post_ff is not None
            x = x + scale * post_attn(attend(x))
            return x + scale * post_ff(layer.mlp(x))
        case "sandwich":
            assert norm_in is not None and pre_ff is not None and post_ff is not None
            x = x + scale * post_attn(attend(norm_in(x)))
            return x + scale * post_ff(layer.mlp(pre_ff(x)))


# (layout, the norms the layer has, under transformers' names)
_LAYOUTS = [
    ("pre", {"input_layernorm", "post_attention_layernorm"}),  # Llama and most families
    ("post", {"post_attention_layernorm", "post_feedforward_layernorm"}),  # OLMo 2
    (
        "sandwich",
        {
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        },
    ),  # Gemma 3
]


@pytest.mark.parametrize(("layout", "norms"), _LAYOUTS)
@pytest.mark.parametrize("residual_multiplier", [1.0, 0.25])  # 0.25: Granite's scaled branches
def test_each_layout_computes_its_composition_with_transformers_names(
    layout: NormLayout, norms: set[str], residual_multiplier: float
) -> None:
    recipe = dataclasses.replace(_RECIPE, norm_layout=layout, residual_multiplier=residual_multiplier)
    layer = build_layer(recipe, attention_backend="eager")
    for module in layer.modules():
        if isinstance(module, RMSNorm):  # non-trivial norm scales, so a misplaced norm shows
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    x, rope = _inputs()

    assert {name for name, m in layer.named_children() if isinstance(m, RMSNorm)} == norms
    torch.testing.assert_close(layer(x, rope, None), _reference(layer, x, rope), rtol=1e-6, atol=1e-6)


def test_the_switches_reach_the_attention_and_the_mlp() -> None:
    recipe = dataclasses.replace(
        _RECIPE,
        qkv_bias=True,
        qk_norm="all_heads",
        sliding_window=3,
        softmax_scale=0.5,
        mlp_bias=True,
        activation="gelu_tanh",
        zero_centered_norms=True,
    )
    layer = build_layer(recipe, attention_backend="eager")
    attention = layer.self_attn

    assert attention.q_proj.bias is not None and attention.o_proj.bias is None  # Qwen2's biases
    assert attention.q_norm is not None and attention.q_norm.weight.shape == (16,)  # all heads' channels
    assert attention.q_norm.zero_centered_weight and layer.post_attention_layernorm.zero_centered_weight
    assert (attention.sliding_window, attention.softmax_scale) == (3, 0.5)
    assert layer.mlp.gate_proj.bias is not None and layer.mlp.activation == "gelu_tanh"


def test_an_o_proj_bias_alone_is_refused() -> None:
    with pytest.raises(ValueError, match=r"o_bias=True.*qkv_bias=True"):
        dataclasses.replace(_RECIPE, o_bias=True)


def _norm() -> RMSNorm:
    return RMSNorm(16)


# (layout, the norms given, the message)
_MISMATCHES = [
    ("pre", {"post_feedforward_layernorm": _norm}, "'pre'.*takes no post_feedforward_layernorm"),
    ("post", {"input_layernorm": _norm}, "'post'.*takes no input_layernorm"),
    ("post", {}, "'post'.*needs post_feedforward_layernorm"),
    (
        "sandwich",
        {"input_layernorm": _norm, "post_feedforward_layernorm": _norm},
        "needs pre_feedforward_layernorm",
    ),
]


@pytest.mark.parametrize(("layout", "given", "message"), _MISMATCHES)
def test_norms_that_do_not_fit_the_layout_are_refused_naming_both(
    layout: NormLayout, given: dict[str, Callable[[], RMSNorm]], message: str
) -> None:
    plain = build_layer(_RECIPE, attention_backend="eager")
    norms = {name: make() for name, make in given.items()}
    with pytest.raises(ValueError, match=message):
        DecoderLayer(
            input_layernorm=norms.get("input_layernorm"),
            self_attn=plain.self_attn,
            post_attention_layernorm=plain.post_attention_layernorm,
            mlp=plain.mlp,
            pre_feedforward_layernorm=norms.get("pre_feedforward_layernorm"),
            post_feedforward_layernorm=norms.get("post_feedforward_layernorm"),
            norm_layout=layout,
        )
