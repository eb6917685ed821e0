"""Tensor parallelism with sequence parallelism for one decoder stage (Megatron's layout).

Between blocks the residual stream is this rank's slice of the sequence (tensor dim 1): norms run
on it locally (``SequenceParallelNorm``); each decoder layer is split as its family's plan says
(``MegatronDecoderPlan`` for Qwen3, Llama, Qwen2: attention and the feed-forward gather the
sequence on entry, split heads / the inner width by columns and reduce-scatter back by rows).
The head gathers the sequence and computes the whole loss on every tp rank with a replicated
weight, so every tp rank reports the same loss and token count (what d9d-loop's loss reduction
expects of a tp group).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._model import DecoderModel
from d9d.hf._decoder._tensor_parallel_plan import (
    DecoderTensorParallelPlan,
    ReplicatedParallel,
    TensorParallelRefusal,
    gather_sequence,
)
from d9d.kernels.layers import MoELayer
from d9d.loop.peft import place_adapters_like_base
from d9d.parallel import SequenceParallelNorm, VocabParallelEmbedding


def tensor_parallel_plan_of(
    family: DecoderFamily, *, tensor_parallel: int
) -> DecoderTensorParallelPlan | None:
    """The family's tensor-parallel plan, checked against the job's tp degree before any weight is built.

    Returns:
        The family's plan (None only for a family without one, under ``tensor_parallel`` 1).

    Raises:
        ValueError: If ``tensor_parallel > 1`` and the family declares no plan or refuses,
            naming its ``model_type`` (and the refusal's reason).
    """
    plan = family.tensor_parallel_plan()
    if isinstance(plan, TensorParallelRefusal):
        if tensor_parallel > 1:
            raise ValueError(
                f"model_type {family.model_type} does not support mesh.tensor_parallel={tensor_parallel}: "
                f"{plan.reason}; set mesh.tensor_parallel: 1 (shard with data_parallel_shard instead)"
            )
        return None
    if plan is None and tensor_parallel > 1:
        raise ValueError(
            f"model_type {family.model_type} has no tensor-parallel plan, so mesh.tensor_parallel="
            f"{tensor_parallel} is not supported for it; set mesh.tensor_parallel: 1 (shard with "
            f"data_parallel_shard instead), or give the family a plan (DecoderFamily.tensor_parallel_plan)"
        )
    return plan


def _replicate_head(head: nn.Module, mesh: DeviceMesh, num_args: int) -> None:
    """The whole sequence and a replicated weight on every tp rank: identical outputs and gradients."""
    parallelize_module(head, mesh, gather_sequence(num_args))
    parallelize_module(head, mesh, ReplicatedParallel())


def _localize_padding_idx(embedding: nn.Embedding, mesh: DeviceMesh) -> None:
    """The padding row in this rank's vocabulary slice, by its local index (None on other ranks).

    ``VocabParallelEmbedding`` looks up local ids (``id - start``) in the local rows; the padding
    row must then be named locally for ``F.embedding`` to leave it out of the gradient.
    """
    pad = embedding.padding_idx
    if pad is None:
        return
    rows = embedding.num_embeddings // mesh.size()
    start = mesh.get_local_rank() * rows
    embedding.padding_idx = pad - start if start <= pad < start + rows else None


def parallelize_decoder_tensor_parallel(model: DecoderModel, *, mesh: DeviceMesh) -> None:
    """Applies tensor and sequence parallelism over the 1-D ``mesh`` to ``model`` in place.

    The sequence length must be divisible by the tp degree, and so must the vocabulary and the
    query and key/value head counts.

    The decoder layers are split as the family's plan (``DecoderFamily.tensor_parallel_plan``)
    says; the embedding, the final norm and the heads as every family's.

    Raises:
        ValueError: For a layout this recipe does not cover: a family without a tensor-parallel
            plan (named by ``model_type``), MoE layers (use expert parallelism over the same
            ranks), or tied embeddings (the vocabulary-sharded embedding and the replicated head
            cannot share one parameter).
    """
    spec = model.spec
    tp = mesh.size()
    backbone = model.model
    layer_plan = tensor_parallel_plan_of(model.config, tensor_parallel=tp)
    if any(isinstance(layer.mlp, MoELayer) for layer in backbone.decoder_layers()):
        raise ValueError(
            f"tensor_parallel={tp} with MoE layers is not supported; use expert_parallel instead"
        )
    if spec.tie_word_embeddings:
        raise ValueError(f"tensor_parallel={tp} with tie_word_embeddings=true is not supported")
    if spec.num_kv_heads % tp != 0:
        raise ValueError(f"num_key_value_heads={spec.num_kv_heads} is not divisible by tensor_parallel={tp}")
    plan: dict[str, ParallelStyle] = {}
    if backbone.embed_tokens is not None:
        plan["embed_tokens"] = VocabParallelEmbedding(sequence_parallel=True)
    for index, layer in zip(model.layout.layers, backbone.decoder_layers(), strict=True):
        if layer_plan is not None:
            plan |= {
                f"layers.{index}.{name}": style for name, style in layer_plan.layer_styles(layer).items()
            }
    if backbone.norm is not None:
        plan["norm"] = SequenceParallelNorm()
    parallelize_module(backbone, mesh, plan)
    if backbone.embed_tokens is not None:
        _localize_padding_idx(backbone.embed_tokens, mesh)
    # LoRA adapters (d9d.loop.peft) laid out after their column- / row-parallel base weights
    place_adapters_like_base(backbone)
    for _, head in model.head_modules():
        # lm_head(hidden_states, labels); a pooling head (hidden_states, attention_mask)
        _replicate_head(head, mesh, num_args=2)
