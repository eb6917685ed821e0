"""Multi-head latent attention against transformers' DeepSeek-V3 attention and a plain-PyTorch reference."""

from typing import Any

import pytest
import torch
from torch import nn

from d9d.kernels import RopeLayout
from d9d.kernels.layers import (
    EagerAttentionBackend,
    MultiHeadLatentAttention,
    RotaryEmbedding,
    SdpaAttentionBackend,
    YarnRopeScaling,
    latent_attention_softmax_scale,
)

transformers = pytest.importorskip("transformers")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

HIDDEN, HEADS, SEQ = 32, 4, 7
WIDTHS = {"kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4}


def _hf_attention(*, q_lora_rank: int | None, v_head_dim: int, interleave: bool, bias: bool) -> Any:
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        v_head_dim=v_head_dim,
        rope_interleave=interleave,
        attention_bias=bias,
        **WIDTHS,
    )
    config._attn_implementation = "eager"
    attention = deepseek.DeepseekV3Attention(config, layer_idx=0)
    for name, param in attention.named_parameters():
        with torch.no_grad():
            param.copy_(
                1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param)
            )
    return attention, deepseek.DeepseekV3RotaryEmbedding(config)


def _ours(hf: Any, *, q_lora_rank: int | None, v_head_dim: int, layout: RopeLayout, bias: bool) -> Any:
    ours = MultiHeadLatentAttention(
        HIDDEN,
        HEADS,
        q_lora_rank=q_lora_rank,
        v_head_dim=v_head_dim,
        bias=bias,
        rope_layout=layout,
        attention_backend=EagerAttentionBackend(),
        **WIDTHS,
    )
    ours.load_state_dict(hf.state_dict())  # transformers' module names
    return ours


CASES = [
    # q_lora_rank, v_head_dim, interleaved rope, biases
    pytest.param(6, 8, True, False, id="q-lora-interleaved-v-narrower"),  # DeepSeek-V3's shape
    pytest.param(None, 16, False, True, id="plain-q-half-v-wider-biases"),  # q_proj, v wider than q/k
    pytest.param(6, 12, False, False, id="q-lora-half-v-equal"),  # no padding at all
]


@pytest.mark.parametrize(("q_lora_rank", "v_head_dim", "interleave", "bias"), CASES)
def test_matches_deepseek_v3_attention(
    q_lora_rank: int | None, v_head_dim: int, interleave: bool, bias: bool
) -> None:
    torch.manual_seed(0)
    hf, hf_rotary = _hf_attention(
        q_lora_rank=q_lora_rank, v_head_dim=v_head_dim, interleave=interleave, bias=bias
    )
    layout: RopeLayout = "interleaved" if interleave else "half"
    ours = _ours(hf, q_lora_rank=q_lora_rank, v_head_dim=v_head_dim, layout=layout, bias=bias)
    hidden = torch.randn(2, SEQ, HIDDEN)
    positions = torch.arange(SEQ)[None].expand(2, -1)
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    mine, theirs = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    expected, _ = hf(theirs, hf_rotary(theirs, positions), causal)
    tables = RotaryEmbedding(WIDTHS["qk_rope_head_dim"], layout=layout)(positions)
    out = ours(mine, tables)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def _reference(
    module: MultiHeadLatentAttention, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """MLA written out with half-layout RoPE and an explicit causal softmax, no padding."""
    batch, seq, _ = hidden.shape
    assert module.q_proj is not None
    query = module.q_proj(hidden).view(batch, seq, HEADS, -1)
    latent, k_rope = module.kv_a_proj_with_mqa(hidden).split(
        [WIDTHS["kv_lora_rank"], WIDTHS["qk_rope_head_dim"]], -1
    )
    kv = module.kv_b_proj(module.kv_a_layernorm(latent)).view(batch, seq, HEADS, -1)
    k_nope, value = kv[..., : WIDTHS["qk_nope_head_dim"]], kv[..., WIDTHS["qk_nope_head_dim"] :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, :, None] + turned * sin[:, :, None]

    nope = WIDTHS["qk_nope_head_dim"]
    q = torch.cat([query[..., :nope], rotate(query[..., nope:])], dim=-1)
    k = torch.cat([k_nope, rotate(k_rope[:, :, None]).expand(-1, -1, HEADS, -1)], dim=-1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * module.softmax_scale
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), value)
    return module.o_proj(attended.reshape(batch, seq, -1))


def test_sdpa_path_matches_the_plain_reference() -> None:
    torch.manual_seed(1)
    module = MultiHeadLatentAttention(
        HIDDEN, HEADS, q_lora_rank=None, v_head_dim=6, attention_backend=SdpaAttentionBackend(), **WIDTHS
    )
    hidden = torch.randn(2, SEQ, HIDDEN)
    cos, sin = RotaryEmbedding(WIDTHS["qk_rope_head_dim"])(torch.arange(SEQ)[None].expand(2, -1))
    torch.testing.assert_close(
        module(hidden, (cos, sin)), _reference(module, hidden, cos, sin), atol=1e-5, rtol=1e-5
    )


class _ListCache:
    """A one-row ``KeyValueCache`` that keeps everything appended (no padding, full causal view)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.new = 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.append(key)
        self.values.append(value)
        self.new = key.shape[1]
        return torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1)

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        total = sum(k.shape[1] for k in self.keys)
        query = torch.arange(total - self.new, total)[:, None]
        return (torch.arange(total)[None] <= query)[None, None]


def test_cached_decoding_equals_the_whole_sequence() -> None:
    torch.manual_seed(2)
    module = MultiHeadLatentAttention(
        HIDDEN,
        HEADS,
        q_lora_rank=6,
        v_head_dim=8,
        rope_layout="interleaved",
        attention_backend="sdpa",
        **WIDTHS,
    )
    rotary = RotaryEmbedding(WIDTHS["qk_rope_head_dim"], layout="interleaved")
    hidden = torch.randn(1, SEQ, HIDDEN)
    positions = torch.arange(SEQ)[None]
    whole = module(hidden, rotary(positions))
    cache = _ListCache()
    prefix = module(hidden[:, :4], rotary(positions[:, :4]), kv_cache=cache)
    steps = [
        module(hidden[:, i : i + 1], rotary(positions[:, i : i + 1]), kv_cache=cache) for i in range(4, SEQ)
    ]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), whole, atol=1e-5, rtol=1e-5)
    assert cache.keys[0].shape[-1] == module.padded_head_dim == 12


def test_yarn_softmax_scale_is_transformers_rule() -> None:
    rope = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, rope_parameters=rope, **WIDTHS
    )
    expected = deepseek.DeepseekV3Attention(config, layer_idx=0).scaling
    yarn = YarnRopeScaling(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)
    assert latent_attention_softmax_scale(12, yarn) == pytest.approx(expected, rel=1e-12)
    assert latent_attention_softmax_scale(12, None) == pytest.approx(12**-0.5, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_lora_rank": 0}, "kv_lora_rank=0"),  # no latent
        ({"q_lora_rank": -1}, "q_lora_rank=-1"),  # a negative rank
    ],
)
def test_bad_widths_are_refused_naming_them(kwargs: dict[str, int], message: str) -> None:
    widths: dict[str, Any] = {**WIDTHS, "q_lora_rank": None, "v_head_dim": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        MultiHeadLatentAttention(HIDDEN, HEADS, **widths)


def test_meta_build_then_reset_materializes() -> None:
    with torch.device("meta"):
        module = MultiHeadLatentAttention(HIDDEN, HEADS, q_lora_rank=6, v_head_dim=8, **WIDTHS)
    module.to_empty(device="cpu")
    module.reset_parameters()
    assert module.q_a_layernorm is not None
    assert torch.all(module.q_a_layernorm.weight == 1) and torch.isfinite(module.kv_b_proj.weight).all()
    assert isinstance(module.o_proj, nn.Linear)
