"""A family's tensor-parallel plan: how each decoder layer's modules split over the tp ranks.

The core applies the parts every family shares (the vocabulary-parallel embedding, the final norm,
replicated heads); the plan names the layer's own modules, because only the family knows them
(a fused QKV projection, another feed-forward, extra norms need another plan). A family without
a plan returns None from ``DecoderFamily.tensor_parallel_plan`` and is refused under
``tensor_parallel > 1`` before any weight is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from d9d.hf._decoder._decoder_layer import DecoderLayer
from d9d.parallel import LocalParameterSlot, SequenceParallelNorm, install_local_forward


def gather_sequence(num_args: int) -> PrepareModuleInput:
    """The first positional input arrives as the sequence slice and is gathered; others pass."""
    passed: tuple[None, ...] = (None,) * (num_args - 1)
    return PrepareModuleInput(
        input_layouts=(Shard(1), *passed), desired_input_layouts=(Replicate(), *passed), use_local_output=True
    )


def feed_forward_styles(layer: DecoderLayer) -> dict[str, ParallelStyle]:
    """The layer's norms on the sequence slice and its SwiGLU split by the inner width.

    What every plan of a layer with a dense ``mlp.{gate,up,down}_proj`` shares.
    """
    styles: dict[str, ParallelStyle] = {
        "post_attention_layernorm": SequenceParallelNorm(),
        "mlp": gather_sequence(1),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for name, norm in (
        ("input_layernorm", layer.input_layernorm),
        ("pre_feedforward_layernorm", layer.pre_feedforward_layernorm),
        ("post_feedforward_layernorm", layer.post_feedforward_layernorm),
    ):
        if norm is not None:
            styles[name] = SequenceParallelNorm()
    return styles


def _replicate_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """``module``'s parameters as ``Replicate()`` DTensors, forward on local tensors, gradients complete."""
    slots: list[LocalParameterSlot] = []
    for owner in module.modules():
        for name, parameter in list(owner.named_parameters(recurse=False)):
            replicated = DTensor.from_local(parameter.detach(), mesh, [Replicate()], run_check=False)
            owner.register_parameter(name, nn.Parameter(replicated, requires_grad=parameter.requires_grad))
            slots.append(LocalParameterSlot(owner=owner, name=name, grad_placements=(Replicate(),)))
    if slots:
        install_local_forward(module, slots)


class ReplicatedParallel(ParallelStyle):
    """A module whose input is whole on every tp rank and whose output gradient is complete there.

    Its parameters become ``Replicate()`` DTensors (forward sees local tensors, so custom kernels
    run); their gradients are the same on every rank and need no reduction.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_parameters(module, device_mesh)
        return module


class DecoderTensorParallelPlan(Protocol):
    """How one decoder layer is split under tensor and sequence parallelism.

    Between layers the residual stream is this rank's slice of the sequence (tensor dim 1);
    a layer's plan must take that slice in and give it back.
    """

    def layer_styles(self, layer: DecoderLayer) -> dict[str, ParallelStyle]:
        """The parallel style of each module of ``layer``, by its name relative to the layer."""
        ...


@dataclass(frozen=True, kw_only=True)
class TensorParallelRefusal:
    """A family's answer that its layers cannot split over tp ranks, and why.

    Attributes:
        reason: Why, as the refusal under ``tensor_parallel > 1`` states it.
    """

    reason: str


class MegatronDecoderPlan:
    """Megatron's layout for a layer of separate q/k/v/o and gate/up/down projections.

    Norms run on the sequence slice, whichever the layer's ``norm_layout`` has (the residual
    stream and each branch's output are both this rank's slice there); attention and the
    feed-forward gather the sequence on entry, split heads / the inner width by columns and
    reduce-scatter back to the slice by rows. Per-head q/k norms (Qwen3) see this rank's heads.
    The plan of Qwen3, Llama, Qwen2, Mistral, Phi-3, Granite and Gemma 3.
    """

    def layer_styles(self, layer: DecoderLayer) -> dict[str, ParallelStyle]:
        """The styles of ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` and the norms.

        Raises:
            ValueError: If the attention's q/k norms span all heads (a rank holds only some).
        """
        if layer.self_attn.q_norm is not None and layer.self_attn.qk_norm_scope == "all_heads":
            raise ValueError(
                "MegatronDecoderPlan splits heads over tp ranks, but this layer's q/k norms span all "
                "heads (qk_norm_scope='all_heads'): a rank cannot normalize its heads alone"
            )
        styles: dict[str, ParallelStyle] = {
            # (hidden_states, position_embeddings); document_ids is a keyword argument
            "self_attn": gather_sequence(2),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            **feed_forward_styles(layer),
        }
        if layer.self_attn.q_norm is not None:
            # per-head norms see this rank's heads: their weight gradients are partial sums
            styles["self_attn.q_norm"] = SequenceParallelNorm()
            styles["self_attn.k_norm"] = SequenceParallelNorm()
        return styles
