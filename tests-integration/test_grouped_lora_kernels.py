"""d9d-loop's grouped LoRA on d9d-kernels' ``GroupedSwiGLUExperts`` (a structural fit)."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.layers import GroupedSwiGLUExperts
from d9d.loop.peft import GroupedLoRAExperts, LoRAConfig, inject_lora, merged_state


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedSwiGLUExperts(4, 8, 6)


def test_grouped_lora_on_kernels_grouped_experts() -> None:
    torch.manual_seed(0)
    block = _Block()
    x, counts = torch.randn(10, 8), torch.tensor([2, 3, 0, 5])
    expected = block.experts(x, counts).detach()
    inject_lora(block, LoRAConfig(target="experts", r=2, alpha=2.0))
    experts = block.experts
    assert isinstance(experts, GroupedLoRAExperts)
    assert experts.adapted == ["gate_proj", "up_proj", "down_proj"]
    torch.testing.assert_close(experts(x, counts), expected, rtol=0, atol=0)
    experts(x, counts).square().sum().backward()
    assert {n for n, p in block.named_parameters() if p.grad is not None} == {
        f"experts.lora_{w}.lora_{m}" for w in ("gate_proj", "up_proj", "down_proj") for m in "AB"
    }
    with torch.no_grad():
        for p in block.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    plain = GroupedSwiGLUExperts(4, 8, 6)
    plain.load_state_dict({k.removeprefix("experts."): v for k, v in merged_state(block).items()})
    torch.testing.assert_close(plain(x, counts), experts(x, counts))
    # reset_parameters initializes the base weights (the experts' own init) and zeroes B
    with torch.no_grad():
        experts.get_parameter("gate_proj").zero_()
    experts.reset_parameters()
    assert float(experts.get_parameter("gate_proj").std()) > 0.01
    for weight in experts.adapted:
        assert (
            float(experts.get_submodule(f"lora_{weight}").get_parameter("lora_B").detach().abs().sum()) == 0
        )
