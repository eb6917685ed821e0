"""Grouped LoRA: one adapter pair per expert on (E, in, out) weights (d9d-kernels' layout)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from d9d.loop.peft import GroupedLoRAExperts, LoRAConfig, inject_lora, merged_state, without_adapters


class _Experts(nn.Module):
    """Plain-torch stand-in for ``GroupedSwiGLUExperts``: the same parameters and call."""

    def __init__(self, experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)
        self.up_proj = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, inner, hidden) * 0.1)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for e, count in enumerate(tokens_per_expert.tolist()):
            x = tokens[start : start + count]
            out.append((F.silu(x @ self.gate_proj[e]) * (x @ self.up_proj[e])) @ self.down_proj[e])
            start += count
        return torch.cat(out)


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.experts = _Experts(3, 6, 4)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(self.proj(x), counts)


def test_grouped_lora_starts_at_the_base_trains_adapters_only_and_merges() -> None:
    torch.manual_seed(0)
    model = _Moe()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    x, counts = torch.randn(7, 6), torch.tensor([3, 0, 4])
    expected = model(x, counts).detach()
    adapted = inject_lora(model, LoRAConfig(target=r"experts\.(gate|down)_proj", r=2, alpha=4.0))
    assert adapted == ["experts"]
    experts = model.experts
    assert isinstance(experts, GroupedLoRAExperts)
    assert experts.adapted == ["gate_proj", "down_proj"]
    # base names unchanged: a base checkpoint loads into the adapted model
    assert set(without_adapters(model).state_dict()) == set(base)
    trained = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {
        "experts.lora_gate_proj.lora_A": (3, 6, 2),
        "experts.lora_gate_proj.lora_B": (3, 2, 4),
        "experts.lora_down_proj.lora_A": (3, 4, 2),
        "experts.lora_down_proj.lora_B": (3, 2, 6),
    }
    # step 0 equals the base
    torch.testing.assert_close(model(x, counts), expected, rtol=0, atol=0)
    # gradients reach the adapters only (B's first; A's once B moved)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        model(x, counts).square().sum().backward()
        optimizer.step()
    for name, parameter in model.named_parameters():
        assert (parameter.grad is not None) == ("lora" in name), name
        if "lora_A" in name:
            assert parameter.grad is not None and bool(parameter.grad.abs().sum() > 0), name
    for name, value in base.items():
        torch.testing.assert_close(model.get_parameter(name), value, rtol=0, atol=0)
    # merged = base + scale * A @ B per expert, and a plain model with it gives the same outputs
    merged = merged_state(model)
    assert set(merged) == set(base)
    for weight in ("gate_proj", "down_proj"):
        adapter = experts.get_submodule(f"lora_{weight}")
        a, b = adapter.get_parameter("lora_A"), adapter.get_parameter("lora_B")
        for e in range(3):
            torch.testing.assert_close(
                merged[f"experts.{weight}"][e], base[f"experts.{weight}"][e] + 2.0 * a[e] @ b[e]
            )
    torch.testing.assert_close(merged["experts.up_proj"], base["experts.up_proj"])
    plain = _Moe()
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x, counts), model(x, counts))


def test_grouped_lora_bad_configs_name_the_layer() -> None:
    with pytest.raises(ValueError, match=r"layer 'experts': LoRA rank r=5 exceeds weight 'gate_proj'"):
        inject_lora(_Moe(), LoRAConfig(target="experts", r=5))
    with pytest.raises(ValueError, match=r"layer 'experts': LoRA on grouped expert weights has no dropout"):
        inject_lora(_Moe(), LoRAConfig(target="experts", r=2, dropout=0.1))
