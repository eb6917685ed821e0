"""The parallelize recipe of a decoder stage (any family): applies whatever the job's mesh asks for."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.hf._decoder._model import DecoderModel
from d9d.hf._decoder._tensor_parallel import parallelize_decoder_tensor_parallel
from d9d.kernels.layers import LongRopeScaling, MoELayer, NtkRopeScaling
from d9d.loop.peft import GroupedLoRAExperts
from d9d.mesh import BATCH_DOMAIN, DENSE_DOMAIN, EXPERT_DOMAIN, DistributedContext
from d9d.parallel import (
    Float8Training,
    Float8WeightCasts,
    cast_parameters_for_compute,
    convert_experts_to_float8,
    convert_to_float8,
    hsdp_mesh,
    parallelize_context_parallel,
    parallelize_expert_parallel,
    parallelize_hsdp,
    prefetch_fsdp_units,
)


@dataclass(frozen=True, kw_only=True)
class FsdpSettings:
    """How FSDP shards a stage over 2+ data-parallel ranks (d9d-hf's ``model.fsdp``).

    Attributes:
        reduce_dtype: Dtype of the gradient reduction (float32 by default).
        forward_prefetch: Following layers whose all-gathers each layer's forward starts.
        backward_prefetch: Preceding layers whose all-gathers each layer's backward starts.
        keep_last_layer_gathered: The last layer is not resharded between forward and backward.
    """

    reduce_dtype: torch.dtype = torch.float32
    forward_prefetch: int = 0
    backward_prefetch: int = 0
    keep_last_layer_gathered: bool = False


def _data_parallel_mesh(dense: DeviceMesh) -> DeviceMesh:
    """FSDP's mesh: shards over ``dp_cp_shard``, replicates over the replicate dims wider than 1.

    Sliced from the dense mesh itself where possible: FSDP over tensor-parallel parameters needs
    its mesh and the tp mesh to come from one root mesh.
    """
    wide = [name for name in ("dp_replicate", "cp_replicate") if dense[name].size() > 1]
    if len(wide) <= 1:
        return dense[(*wide, "dp_cp_shard")]
    if dense["tp"].size() > 1:
        raise ValueError(
            "data_parallel_replicate > 1 and context_parallel_replicate > 1 together with "
            "tensor_parallel > 1 is not supported (FSDP needs one replicate dim beside tp)"
        )
    return hsdp_mesh(dense["dp_replicate", "dp_cp_shard", "cp_replicate"])


def _apply_float8(
    model: DecoderModel,
    float8: Float8Training,
    *,
    experts: bool,
    expert_weight_casts: Float8WeightCasts | None,
) -> None:
    """FP8 linear layers (and grouped experts), before any parallelism wraps them. LoRA layers
    keep their adapters in the compute dtype and run their frozen base product in FP8."""
    modules = cast(Iterator[tuple[str, nn.Module]], model.named_modules())
    adapted_experts = [name for name, m in modules if isinstance(m, GroupedLoRAExperts)]
    if experts and adapted_experts:
        raise ValueError(
            f"model.float8.experts with LoRA on the experts (peft) is not supported: the FP8 grouped "
            f"GEMM has no adapter path ({', '.join(adapted_experts[:4])}, ...); set "
            f"model.float8.experts: false or leave the experts out of peft.target"
        )
    convert_to_float8(model, float8)
    if experts:
        for layer in model.model.decoder_layers():
            if isinstance(layer.mlp, MoELayer):
                convert_experts_to_float8(layer.mlp.experts, expert_weight_casts)


def _refuse_length_dependent_rope(model: DecoderModel) -> None:
    """A rope whose frequencies follow the longest position of a forward would see only its rank's
    shard of the positions under context parallelism, and ranks would rotate with different
    frequencies."""
    match model.spec.rope_scaling:
        case LongRopeScaling() | NtkRopeScaling(sequence_length=None):
            kind = type(model.spec.rope_scaling).__name__
            raise ValueError(
                f"context_parallel > 1 with {kind} ({type(model.config).__name__}'s rope block): its "
                "frequencies depend on the longest position of a forward, which a context-parallel rank "
                "sees only a shard of; train this model without context parallelism"
            )
        case _:
            return


def parallelize_decoder(
    model: DecoderModel,
    *,
    dist_context: DistributedContext,
    param_dtype: torch.dtype | None = None,
    float8: Float8Training | None = None,
    float8_experts: bool = False,
    float8_expert_weight_casts: Float8WeightCasts | None = None,
    fsdp: FsdpSettings | None = None,
) -> None:
    """Parallelizes one (meta-device) decoder stage in place, as ``dist_context.parameters`` asks.

    Pipeline parallelism needs nothing here: the stage was built with only its layers. The
    order matters: FP8 conversion first (``float8``: torchao swaps the linear layers, which
    tensor parallelism and FSDP then shard like any other), tensor parallelism next (it places
    parameters on the tp mesh dim), then context parallelism (an attention backend, no
    parameters), expert parallelism (the experts leave FSDP's care), and FSDP/HSDP last over
    the data-parallel and cp-shard ranks, per decoder layer and then the rest, so each layer's
    parameters are gathered only around it.
    On a single data-parallel rank there is nothing to shard: parameters stored in
    ``param_dtype`` are used as they are; others are cast once per forward without FSDP
    (``cast_parameters_for_compute``; compiled layer bodies read the cast copies as graph
    inputs), or, where forward reruns in backward (activation checkpointing), the stage is one
    FSDP unit (per-layer units with experts).

    Args:
        model: The stage, on the meta device.
        dist_context: The job's distributed context (its mesh domains).
        param_dtype: The compute dtype of the parameters (None: the stored dtype).
        float8: FP8 training of the stage's linear layers (None: none).
        float8_experts: Also run the MoE experts' grouped GEMMs in FP8 (needs ``float8``).
        float8_expert_weight_casts: Where the FP8 experts keep their weights' casts across
            microbatches (clear it after each optimizer step; None: cast in every microbatch).
        fsdp: Reduction dtype, prefetch and resharding where the stage is sharded over 2+
            data-parallel ranks (None: float32 reductions, FSDP's implicit prefetch).

    Raises:
        ValueError: For ``float8_experts`` on a stage whose experts carry LoRA adapters,
            ``float8_experts`` without ``float8``, ``float8_expert_weight_casts`` without
            ``float8_experts``, or context parallelism with a rope whose
            frequencies depend on the sequence's length (LongRoPE, dynamic NTK).
    """
    if float8 is not None:
        _apply_float8(model, float8, experts=float8_experts, expert_weight_casts=float8_expert_weight_casts)
    elif float8_experts:
        raise ValueError("float8_experts needs float8 settings")
    if float8_expert_weight_casts is not None and not float8_experts:
        raise ValueError("float8_expert_weight_casts needs float8_experts")
    mesh = dist_context.parameters
    dense = dist_context.mesh_for(DENSE_DOMAIN)
    if mesh.tensor_parallel > 1:
        parallelize_decoder_tensor_parallel(model, mesh=dense["tp"])
    layers = model.model.decoder_layers()
    if mesh.context_parallel > 1:
        _refuse_length_dependent_rope(model)
        cp_mesh = dist_context.mesh_for(BATCH_DOMAIN)["cp"]
        for layer in layers:
            parallelize_context_parallel(layer.self_attn, mesh=cp_mesh)
    experts: list[nn.Parameter] = []
    if mesh.expert_parallel > 1:
        ep_mesh = dist_context.mesh_for(EXPERT_DOMAIN)["ep_replicate", "ep_shard"]
        for layer in layers:
            if isinstance(layer.mlp, MoELayer):
                parallelize_expert_parallel(layer.mlp, mesh=ep_mesh)
                experts += list(layer.mlp.parameters())
    dp_mesh = _data_parallel_mesh(dense)
    fsdp = FsdpSettings() if fsdp is None else fsdp
    sharded = dp_mesh.size() > 1
    if sharded and fsdp.reduce_dtype != torch.float32:
        reduce_dtype: torch.dtype | None = fsdp.reduce_dtype
    else:
        reduce_dtype = None if param_dtype is None else torch.float32
    # One data-parallel rank shards nothing: per-layer units would only add a gather, a cast and a
    # reduce per layer and step (host time the GPU waits on; with experts, copies of every expert
    # weight and gradient: 55 ms of a 266 ms step at Qwen3-30B-A3B widths on an H200). The cast
    # keeps each compute copy from forward to backward (the experts' bf16 weights: half their
    # float32 size).
    # A forward that reruns in backward must see the cast parameters as parameters. Compiled layer
    # bodies need not: the stage's hooks run outside them and the copies enter as graph inputs.
    # Parameters stored in the compute dtype already (bf16 master weights) need no cast at all: a
    # unit would only gather a second copy of the whole stage and reduce a third (8B LoRA on one
    # GPU: 15 GiB of copies).
    reruns = model.model.activation_checkpointing
    if not sharded and param_dtype is not None and mesh.tensor_parallel == 1:
        stored = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if stored <= {param_dtype}:
            return
        if not reruns:
            cast_parameters_for_compute(model, param_dtype)
            return
    # Otherwise, experts go in per-layer units even on one rank: one unit for the stage would hold
    # every expert's gathered weights at once.
    per_layer = sharded or model.spec.has_experts
    if per_layer:
        for index, layer in enumerate(layers):
            last = index == len(layers) - 1
            parallelize_hsdp(
                layer,
                mesh=dp_mesh,
                reshard_after_forward=not (sharded and last and fsdp.keep_last_layer_gathered),
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                ignored_params=experts,
            )
        if sharded:
            prefetch_fsdp_units(list(layers), forward=fsdp.forward_prefetch, backward=fsdp.backward_prefetch)
    parallelize_hsdp(
        model,
        mesh=dp_mesh,
        reshard_after_forward=per_layer,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        ignored_params=experts,
    )
