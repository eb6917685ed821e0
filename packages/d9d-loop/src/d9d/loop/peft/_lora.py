"""LoRA: a linear layer with a trainable low-rank update, its injection by name, and merging."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

LinearProduct = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``(input, weight, bias) -> output`` as ``torch.nn.functional.linear`` computes it."""


class QuantizedWeight(Protocol):
    """A frozen base weight stored quantized (d9d-loop's NF4 weight fits), in a ``LoRALinear``."""

    def linear(self, input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``input @ W.T + bias`` with ``W`` dequantized to ``input``'s dtype (no gradient to ``W``)."""
        ...

    def dequantize(self) -> torch.Tensor:
        """``W`` as a dense tensor in the dtype it was quantized from."""
        ...


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus ``scale * B @ A``; the base ``weight`` and ``bias`` keep their names.

    Being an ``nn.Linear`` (same ``weight``, ``bias``), the layer loads base checkpoints under
    the base names, and is sharded by FSDP like its base layer (``lora_A`` and ``lora_B`` are
    ordinary parameters of the same module).

    The base product runs through ``base_linear`` (``F.linear`` by default); replacing it (an FP8
    matmul, say: d9d-parallel's ``convert_to_float8`` does) changes the arithmetic of the frozen
    base, never the parameters or the adapters, which stay in the compute dtype.

    ``quantize`` stores the frozen base weight quantized instead (a 4-bit base): ``weight`` is
    then no parameter any more, and the base product runs through the quantized weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if r > min(in_features, out_features):
            raise ValueError(
                f"LoRA rank r={r} exceeds the layer's smaller side "
                f"(in_features={in_features}, out_features={out_features})"
            )
        self.r, self.scale = r, alpha / r
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lora_A = nn.Parameter(torch.empty(r, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, r, device=device, dtype=dtype))
        # a float, not an nn.Dropout child: RowwiseParallel partitions every submodule as a linear
        self.lora_dropout = dropout
        self.base_linear: LinearProduct = F.linear
        self.quantized: QuantizedWeight | None = None
        self.reset_lora_parameters()

    def reset_parameters(self) -> None:
        """The base layer's initialization, then the adapters' (A Kaiming uniform, B zero)."""
        super().reset_parameters()
        if hasattr(self, "lora_A"):  # nn.Linear.__init__ calls this before the adapters exist
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """A Kaiming uniform (as ``nn.Linear``'s weight), B zero: the update starts at zero."""
        with torch.no_grad():
            fill_adapter(self.lora_A, lambda full: nn.init.kaiming_uniform_(full, a=math.sqrt(5)))
            fill_adapter(self.lora_B, nn.init.zeros_)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        update = F.linear(
            F.linear(F.dropout(input, self.lora_dropout, self.training), self.lora_A), self.lora_B
        )
        if self.quantized is not None:
            return self.quantized.linear(input, self.bias) + self.scale * update
        return self.base_linear(input, self.weight, self.bias) + self.scale * update

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A``, the update the adapters add to ``weight``."""
        return self.scale * (self.lora_B @ self.lora_A)

    def base_weight(self) -> torch.Tensor:
        """The frozen base weight as a dense tensor (dequantized where ``quantize`` stored it)."""
        return self.weight if self.quantized is None else self.quantized.dequantize()

    def merged_weight(self) -> torch.Tensor:
        """``W + scale * B @ A`` in the base weight's dtype (what an export of the plain model holds)."""
        base = self.base_weight()
        return base + self.delta_weight().to(base.dtype)

    def quantize(self, quantized: QuantizedWeight) -> None:
        """Replaces the base ``weight`` parameter by ``quantized`` (freeing the dense weight)."""
        self.register_parameter("weight", None)
        self.quantized = quantized


def fill_adapter(parameter: torch.Tensor, init: Callable[[torch.Tensor], object]) -> None:
    """Initializes a parameter from a full CPU tensor, sliced per rank for a DTensor (so every
    layout starts from the same adapters as one process)."""
    if parameter.device.type == "meta":
        return
    full = torch.empty(parameter.shape, dtype=parameter.dtype)
    init(full)
    if isinstance(parameter, DTensor):
        dtensor: DTensor = parameter
        local = distribute_tensor(
            full.to(dtensor.device), dtensor.device_mesh, dtensor.placements, src_data_rank=None
        ).to_local()
        dtensor.to_local().copy_(local)
    else:
        parameter.copy_(full)
