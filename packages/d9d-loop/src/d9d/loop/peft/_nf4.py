"""A 4-bit NF4 base under LoRA (QLoRA) through bitsandbytes: refusals, host staging, quantization.

Why bitsandbytes and not torchao's ``NF4Tensor`` (docs/one-gpu.md has the details): its NF4
dequantization runs in CUDA kernels of its own (torchao's is a chain of eager ops behind a tensor
subclass whose dispatch is marked ``torch._dynamo.disable``), its 4-bit API is the one
transformers' and PEFT's QLoRA call while torchao's NF4 moved modules, its native library is
loaded through ctypes (one wheel for every torch version, CPU included: our tests run it), and
its quantization error is slightly lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.loop._optional_import import import_extra
from d9d.loop.peft._config import LoRAConfig, NF4BaseConfig, PeftConfig
from d9d.loop.peft._inject import named_modules
from d9d.loop.peft._lora import LoRALinear
from d9d.mesh import MeshParameters


def nf4_base_of(config: PeftConfig) -> NF4BaseConfig | None:
    """The NF4 settings of a LoRA run with a 4-bit base, else None."""
    if isinstance(config, LoRAConfig) and isinstance(config.base, NF4BaseConfig):
        return config.base
    return None


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes, or ``MissingExtraError`` naming the ``quant`` extra."""
    return import_extra("bitsandbytes", extra="quant", feature="trainer.peft.base: {kind: nf4}")


def refuse_quantized_base_on_mesh(mesh: MeshParameters, config: PeftConfig) -> None:
    """Refuses a 4-bit base on a mesh that would shard its weights (checked before any work).

    The NF4 weight is one whole tensor per layer: tensor parallelism would split it, and FSDP over
    2+ data-parallel (or context-parallel) ranks would shard it. Pipeline parallelism is fine.
    """
    if nf4_base_of(config) is None:
        return
    sharding = {
        "mesh.tensor_parallel": mesh.tensor_parallel,
        "mesh.data_parallel_replicate": mesh.data_parallel_replicate,
        "mesh.data_parallel_shard": mesh.data_parallel_shard,
        "mesh.context_parallel_replicate": mesh.context_parallel_replicate,
        "mesh.context_parallel_shard": mesh.context_parallel_shard,
        "mesh.expert_parallel": mesh.expert_parallel,
    }
    wide = {key: size for key, size in sharding.items() if size > 1}
    if wide:
        named = ", ".join(f"{key}={size}" for key, size in wide.items())
        raise ValueError(
            f"trainer.peft.base: {{kind: nf4}} cannot be combined with {named}: the 4-bit base "
            f"weights are whole tensors per layer, which tensor parallelism would split and FSDP "
            f"would shard; run it on one data-parallel rank (pipeline_parallel may be > 1)"
        )
    import_bitsandbytes()


def adapted_linears(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """Every ``LoRALinear`` of ``model`` with its qualified name."""
    return [(n, m) for n, m in named_modules(model) if isinstance(m, LoRALinear)]


def check_quantizable(model: nn.Module, config: PeftConfig) -> None:
    """Refuses, before the base is loaded, a stage whose LoRA layers a 4-bit base cannot hold.

    Call after the provider's parallelize: a sharded base weight (tensor parallelism, FSDP), an
    FP8 base product (``model.float8``) and a base weight ``peft.trainable`` trains are refused,
    each naming the layer.
    """
    if nf4_base_of(config) is None:
        return
    layers = adapted_linears(model)
    if not layers:
        raise ValueError(
            f"trainer.peft.base: {{kind: nf4}} quantizes the base of LoRA linear layers, and "
            f"{type(model).__name__} has none (peft.target matched only grouped experts)"
        )
    for name, layer in layers:
        if isinstance(layer.weight, DTensor):
            raise ValueError(
                f"trainer.peft.base: {{kind: nf4}}: layer '{name}' was sharded by the model provider "
                f"(placements {layer.weight.placements}); a 4-bit base needs unsharded weights (no "
                f"tensor parallelism, one data-parallel rank; with d9d-hf on one GPU also no FSDP "
                f"unit: store the weights in the compute dtype, model.master_dtype: bfloat16 and "
                f"model.param_dtype: bfloat16)"
            )
        if layer.base_linear is not F.linear:
            raise ValueError(
                f"trainer.peft.base: {{kind: nf4}} cannot be combined with FP8 (model.float8): layer "
                f"'{name}' runs its base product through {layer.base_linear!r}; remove model.float8"
            )
        if layer.weight.requires_grad:
            raise ValueError(
                f"trainer.peft.base: {{kind: nf4}}: peft.trainable matches '{name}.weight', which "
                f"the 4-bit base freezes; narrow peft.trainable"
            )


def stage_bases_on_host(model: nn.Module, config: PeftConfig, device: torch.device) -> None:
    """``model.to_empty(device=device)``, with a 4-bit base's weights materialized on the host.

    Call after the provider's parallelize, before loading: ``check_quantizable`` runs first. The
    base weights are loaded on the host and quantized onto ``device`` one layer at a time
    (``quantize_bases``), so the device never holds the adapted layers' bf16 weights at once.
    """
    if nf4_base_of(config) is None:
        model.to_empty(device=device)
        return
    check_quantizable(model, config)
    layers = adapted_linears(model)
    metas = [layer.weight for _, layer in layers]
    for _, layer in layers:
        layer.register_parameter("weight", None)
    model.to_empty(device=device)
    for (_, layer), meta in zip(layers, metas, strict=True):
        host = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
        layer.weight = nn.Parameter(host, requires_grad=False)


@dataclass(kw_only=True, frozen=True)
class QuantizationReport:
    """What ``quantize_bases`` did: layers, bytes before and after, and the error it made.

    Attributes:
        layers: How many base weights were quantized.
        dense_bytes: Their size as loaded.
        quantized_bytes: Their size in NF4 (packed weights and scales).
        relative_error: ``||dequantize(Q(W)) - W||_F / ||W||_F`` over all of them together.
    """

    layers: int
    dense_bytes: int
    quantized_bytes: int
    relative_error: float


class NF4Weight(nn.Module):
    """A weight in bitsandbytes' NF4: packed 4-bit codes (a non-persistent buffer) and block scales.

    Not saved in checkpoints (``weight`` is frozen, so a LoRA checkpoint holds only the
    adapters; a resume loads and quantizes the base again, to the same codes).
    """

    def __init__(self, weight: torch.Tensor, config: NF4BaseConfig, bnb: ModuleType) -> None:
        super().__init__()
        packed, state = bnb.functional.quantize_4bit(
            weight, blocksize=config.block_size, compress_statistics=config.double_quant, quant_type="nf4"
        )
        self.register_buffer("packed", packed, persistent=False)
        self._state = state
        self._bnb = bnb

    def linear(self, input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``input @ W.T + bias``, ``W`` dequantized to ``input``'s dtype in forward and backward."""
        packed: torch.Tensor = self.get_buffer("packed")
        output: torch.Tensor = self._bnb.matmul_4bit(input, packed.t(), quant_state=self._state, bias=bias)
        return output

    def dequantize(self) -> torch.Tensor:
        """``W`` dense, in the dtype it was quantized from."""
        dense: torch.Tensor = self._bnb.functional.dequantize_4bit(self.get_buffer("packed"), self._state)
        return dense

    def nbytes(self) -> int:
        """Bytes of the packed codes and the block scales (not the shared 256-entry code tables)."""
        state = self._state
        total = self.get_buffer("packed").nbytes + state.absmax.nbytes
        if state.nested:
            total += state.state2.absmax.nbytes
        return int(total)


@torch.no_grad()
def quantize_bases(model: nn.Module, config: PeftConfig, device: torch.device) -> QuantizationReport | None:
    """Quantizes each LoRA layer's (loaded) base weight to NF4 on ``device``, one layer at a time,
    freeing the dense weight; None without a 4-bit base."""
    settings = nf4_base_of(config)
    if settings is None:
        return None
    bnb = import_bitsandbytes()
    dense_bytes = quantized_bytes = 0
    error = norm = 0.0
    for _, layer in adapted_linears(model):
        dense = layer.weight.detach().to(device)
        quantized = NF4Weight(dense, settings, bnb)
        # squares summed in float32 without a float32 copy of the weight
        error += float((quantized.dequantize() - dense).square().sum(dtype=torch.float32))
        norm += float(dense.square().sum(dtype=torch.float32))
        dense_bytes += dense.nbytes
        quantized_bytes += quantized.nbytes()
        layer.quantize(quantized)
        del dense
    return QuantizationReport(
        layers=len(adapted_linears(model)),
        dense_bytes=dense_bytes,
        quantized_bytes=quantized_bytes,
        relative_error=(error / norm) ** 0.5 if norm > 0 else 0.0,
    )
