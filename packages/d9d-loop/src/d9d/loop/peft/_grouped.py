"""Grouped LoRA: one adapter pair per expert on a module's 3-d ``(E, in, out)`` weights."""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn
from torch.func import functional_call

from d9d.loop.peft._lora import fill_adapter


class GroupedExperts(Protocol):
    """What grouped LoRA adapts, structurally (d9d-kernels' ``GroupedSwiGLUExperts`` fits).

    A module called as ``experts(tokens, tokens_per_expert)`` whose direct parameters include
    "grouped projection weights": 3-d tensors of shape ``(E, in, out)`` applied as
    ``tokens_e @ W[e]`` to the rows of expert ``e``; it has no submodules.
    """

    def __call__(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor: ...


def grouped_weight_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s direct 3-d parameters (empty for a module with submodules)."""
    if any(True for _ in module.children()):
        return []
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]


class _ExpertAdapter(nn.Module):
    """``lora_A`` of shape ``(E, in, r)`` and ``lora_B`` of shape ``(E, r, out)``: the layout of
    the grouped weight, so ``W[e] + scale * A[e] @ B[e]`` and expert parallelism shards both
    ``Shard(0)`` with the experts."""

    def __init__(self, weight: torch.Tensor, r: int) -> None:
        super().__init__()
        experts, d_in, d_out = weight.shape
        self.lora_A = nn.Parameter(torch.empty(experts, d_in, r, device=weight.device, dtype=weight.dtype))
        self.lora_B = nn.Parameter(torch.empty(experts, r, d_out, device=weight.device, dtype=weight.dtype))
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """A uniform in ``±1/sqrt(in)`` per expert (``LoRALinear``'s Kaiming uniform), B zero."""
        bound = 1 / math.sqrt(self.lora_A.shape[1])
        with torch.no_grad():
            fill_adapter(self.lora_A, lambda full: nn.init.uniform_(full, -bound, bound))
            fill_adapter(self.lora_B, nn.init.zeros_)


class GroupedLoRAExperts(nn.Module):
    """Grouped experts with a LoRA pair per expert on each chosen 3-d weight.

    Holds the base module's parameters and buffers under their own names (``gate_proj``, ...,
    so base checkpoints load unchanged) and the adapters as ``lora_<weight>.lora_A`` /
    ``.lora_B``. The forward runs the base module's own forward (its fused kernels) with each
    adapted weight replaced by ``W + scale * A @ B`` (``torch.func.functional_call``), so it
    costs one weight-sized temporary per adapted weight. No dropout: the update is merged into
    the weight, where input dropout has no meaning.
    """

    def __init__(self, base: nn.Module, names: list[str], *, r: int, alpha: float) -> None:
        super().__init__()
        for name in names:
            weight = dict(base.named_parameters(recurse=False))[name]
            if r > min(weight.shape[1], weight.shape[2]):
                raise ValueError(
                    f"LoRA rank r={r} exceeds weight '{name}''s smaller side (shape {tuple(weight.shape)})"
                )
        self.r, self.scale, self.adapted = r, alpha / r, list(names)
        for name, parameter in list(base.named_parameters(recurse=False)):
            self.register_parameter(name, parameter)
            # the base keeps a meta placeholder: the real tensor lives (and is sharded) here only
            base.register_parameter(name, nn.Parameter(torch.empty_like(parameter, device="meta")))
        for name, buffer in list(base.named_buffers(recurse=False)):
            self.register_buffer(name, buffer)
        for name in names:
            self.add_module(f"lora_{name}", _ExpertAdapter(self.get_parameter(name), r))
        self._base = (base,)  # in a tuple: called functionally, not a submodule of this tree

    def delta_weight(self, name: str) -> torch.Tensor:
        """``scale * A @ B`` of shape ``(E, in, out)``, the update the adapters add to ``name``."""
        adapter = self.get_submodule(f"lora_{name}")
        if not isinstance(adapter, _ExpertAdapter):
            raise TypeError(f"lora_{name} is a {type(adapter).__name__}, not a grouped adapter")
        # attribute reads: under expert parallelism the forward sees the local tensors there
        return self.scale * torch.bmm(adapter.lora_A, adapter.lora_B)

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Every base parameter and buffer by name, each adapted weight merged."""
        state: dict[str, torch.Tensor] = dict(self.named_parameters(recurse=False))
        state.update(self.named_buffers(recurse=False))
        for name in self.adapted:
            state[name] = state[name] + self.delta_weight(name).to(state[name].dtype)
        return state

    def reset_parameters(self) -> None:
        """The base module's ``reset_parameters`` on this module's tensors, then the adapters'."""
        base = self._base[0]
        reset = getattr(base, "reset_parameters", None)
        if callable(reset):
            # point the base at the live (possibly sharded) tensors, initialize them in place
            for name, parameter in self.named_parameters(recurse=False):
                base.register_parameter(name, parameter)
            reset()
            for name, parameter in self.named_parameters(recurse=False):
                base.register_parameter(name, nn.Parameter(torch.empty_like(parameter, device="meta")))
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """Every adapter back to its initial value (B = 0)."""
        for name in self.adapted:
            adapter = self.get_submodule(f"lora_{name}")
            if isinstance(adapter, _ExpertAdapter):
                adapter.reset_lora_parameters()

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = functional_call(
            self._base[0], self.merged_weights(), (tokens, tokens_per_expert)
        )
        return output

    def extra_repr(self) -> str:
        return f"{type(self._base[0]).__name__}, adapted={self.adapted}, r={self.r}, scale={self.scale}"
