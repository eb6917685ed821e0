"""The decoder stack of one pipeline stage: embedding (first stage), layers, norm (last stage)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.hf._decoder._decoder_layer import DecoderLayer
from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._spec import DecoderSpec
from d9d.hf._decoder._stage import StageLayout
from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    KeyValueCache,
    MoELayer,
    RMSNorm,
    RotaryEmbedding,
    TokenEmbedding,
    select_attention_backend,
)


class DecoderBackbone(nn.Module):
    """The decoder layers ``layout.layers`` of a model of any family, named as Hugging Face names them.

    ``layers`` is a ``ModuleDict`` keyed by the global layer index, so a stage's state-dict names
    (``layers.17.self_attn.q_proj.weight``) are those of the full model and a checkpoint maps onto
    any stage without renumbering. With a ``pad_token_id`` the embedding's ``padding_idx`` is set,
    as transformers builds it: that row keeps its value and gets no gradient.

    Args:
        family: The family's config (builds each decoder layer).
        spec: The model's numbers (``family.decoder_spec()``).
        layout: Which layers, and whether the embedding and final norm are here.
        activation_checkpointing: Recompute each decoder layer in backward instead of keeping its
            activations (``torch.utils.checkpoint``, non-reentrant), when training.
        attention_backend: One backend object for every attention layer: a name or None is
            resolved here once (``select_attention_backend``, with sinks when the spec says so),
            so the layers share its caches (block masks, packed documents' offsets).
    """

    def __init__(
        self,
        family: DecoderFamily,
        spec: DecoderSpec,
        layout: StageLayout,
        *,
        activation_checkpointing: bool = False,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        self.pad_token_id = spec.pad_token_id
        self.embedding_multiplier = spec.embedding_multiplier
        self.round_embedding_multiplier = spec.round_embedding_multiplier
        self.embed_tokens: TokenEmbedding | None = None
        if layout.is_first:
            self.embed_tokens = TokenEmbedding(
                spec.vocab_size, spec.hidden_size, init_std=spec.initializer_range
            )
            # nn.Embedding's own padding_idx: F.embedding leaves that row out of the gradient
            self.embed_tokens.padding_idx = spec.pad_token_id
        backend = (
            select_attention_backend(attention_backend, sinks=spec.attention_sinks)
            if attention_backend is None or isinstance(attention_backend, str)
            else attention_backend
        )
        self.layers = nn.ModuleDict(
            {str(i): family.build_decoder_layer(i, attention_backend=backend) for i in layout.layers}
        )
        self.norm = (
            RMSNorm(spec.hidden_size, spec.rms_norm_eps, zero_centered_weight=spec.zero_centered_final_norm)
            if layout.is_last
            else None
        )
        rotary_dim = spec.head_dim if spec.rotary_dim is None else spec.rotary_dim
        self.rotary_emb = RotaryEmbedding(
            rotary_dim, theta=spec.rope_theta, scaling=spec.rope_scaling, layout=spec.rope_layout
        )
        self.alternate_rotary_emb: RotaryEmbedding | None = None
        if spec.alternate_rope_theta is not None:
            self.alternate_rotary_emb = RotaryEmbedding(
                rotary_dim, theta=spec.alternate_rope_theta, layout=spec.rope_layout
            )
        self.alternate_rope_layers = spec.alternate_rope_layers
        self._overlap_point: Callable[[torch.Tensor], None] | None = None

    def set_overlap_point(self, point: Callable[[torch.Tensor], None] | None) -> None:
        """Installs ``point``, called with the residual stream after each decoder layer (None removes it).

        d9d-pipeline's ``OverlapPoints``: where DualPipeV's overlapped forward and backward take turns.
        """
        self._overlap_point = point

    def compile_layers(self) -> None:
        """Compiles each decoder layer's body (``DecoderLayer.compile_block``)."""
        for layer in self.decoder_layers():
            layer.compile_block()

    def reset_parameters(self) -> None:
        """Resets every layer and recomputes the rotary frequencies (a padding row starts at zero)."""
        if self.embed_tokens is not None:
            self.embed_tokens.reset_parameters()
            self._zero_padding_row()
        for layer in self.decoder_layers():
            layer.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        for rotary in self._rotary_embeddings():
            rotary.reset_parameters()

    @torch.no_grad()
    def _zero_padding_row(self) -> None:
        """Zeroes the padding row, as transformers initializes it (sharded weights too)."""
        embedding = self.embed_tokens
        pad = self.pad_token_id  # the global row (tensor parallelism makes padding_idx local)
        if embedding is None or pad is None or embedding.weight.is_meta:
            return
        weight = embedding.weight
        if isinstance(weight, DTensor):
            keep = torch.ones(weight.shape[0], 1, dtype=weight.dtype, device=weight.to_local().device)
            keep[pad] = 0
            weight.mul_(distribute_tensor(keep, weight.device_mesh, weight.placements))
        else:
            weight[pad].zero_()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recomputes the non-persistent buffers (rotary frequencies in fp32, MoE token counts).

        For a model materialized with ``to_empty`` and then loaded from a checkpoint, which fills
        parameters only.
        """
        for rotary in self._rotary_embeddings():
            if rotary.inv_freq.dtype != torch.float32:
                rotary.inv_freq = torch.empty_like(rotary.inv_freq, dtype=torch.float32)
            rotary.reset_parameters()
        for layer in self.decoder_layers():
            if isinstance(layer.mlp, MoELayer):
                layer.mlp.tokens_per_expert = torch.zeros_like(
                    layer.mlp.tokens_per_expert, dtype=torch.float32
                )

    def pop_load_balancing_statistics(self) -> torch.Tensor | None:
        """Sum of this stage's routing statistics of the last training forward, if any.

        MoELayer's ``load_balancing_statistics``, summed over the stage's sparse layers: the
        last stage pools every layer's into one loss.
        """
        statistics = [
            found
            for layer in self.decoder_layers()
            if isinstance(layer.mlp, MoELayer)
            and (found := layer.mlp.pop_load_balancing_statistics()) is not None
        ]
        return torch.stack(statistics).sum(dim=0) if statistics else None

    def _rotary_embeddings(self) -> list[RotaryEmbedding]:
        alternate = [] if self.alternate_rotary_emb is None else [self.alternate_rotary_emb]
        return [self.rotary_emb, *alternate]

    def position_embeddings(
        self, position_ids: torch.Tensor, *, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(cos, sin)`` tables of each of this stage's layers, in ``decoder_layers`` order.

        A layer in the spec's ``alternate_rope_layers`` gets the alternate base's tables, every
        other layer the main ones; each set is computed once.
        """
        main = self.rotary_emb(position_ids, dtype=dtype)
        alternate = (
            None
            if self.alternate_rotary_emb is None
            else self.alternate_rotary_emb(position_ids, dtype=dtype)
        )
        return [
            alternate if alternate is not None and int(key) in self.alternate_rope_layers else main
            for key, layer in self.layers.items()
            if isinstance(layer, DecoderLayer)
        ]

    def decoder_layers(self) -> list[DecoderLayer]:
        """This stage's decoder layers in order."""
        return [layer for layer in self.layers.values() if isinstance(layer, DecoderLayer)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``(batch, seq, hidden)`` times ``embedding_multiplier``; first stage only."""
        if self.embed_tokens is None:
            raise RuntimeError("this stage holds no token embedding (it is not the first stage)")
        embedded = self.embed_tokens(input_ids)
        if self.embedding_multiplier == 1.0:
            return embedded
        if self.round_embedding_multiplier:
            # a device-side fill, no host-to-device copy: a decode step stays capturable in a CUDA graph
            return embedded * embedded.new_full((), self.embedding_multiplier)
        return embedded * self.embedding_multiplier

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        run_layers: bool = True,
    ) -> torch.Tensor:
        """Runs this stage's layers (and the final norm on the last stage).

        Args:
            hidden_states: ``(batch, seq, hidden)``.
            position_ids: ``(batch, seq)`` rotary positions.
            document_ids: ``(batch, seq)`` packed-document ids, or None for one sequence per row.
            token_mask: ``(batch, seq)``, nonzero on the tokens the MoE layers' load-balancing
                statistics count (the caller's ``attention_mask``: padding left out); None
                counts every token.
            run_layers: False skips the decoder layers (identity: each keeps the residual
                stream's shape and dtype), for the pipeline's meta-device shape pass.
        """
        layers = self.decoder_layers() if run_layers else []
        tables = self.position_embeddings(position_ids, dtype=hidden_states.dtype) if run_layers else []
        for layer, position_embeddings in zip(layers, tables, strict=True):
            if self.activation_checkpointing and self.training:
                output = torch.utils.checkpoint.checkpoint(
                    layer,
                    hidden_states,
                    position_embeddings,
                    document_ids,
                    token_mask=token_mask,
                    use_reentrant=False,
                )
                if not isinstance(output, torch.Tensor):
                    raise TypeError("a checkpointed decoder layer returned no tensor")
                hidden_states = output
            else:
                hidden_states = layer(hidden_states, position_embeddings, document_ids, token_mask=token_mask)
            if self._overlap_point is not None:
                self._overlap_point(hidden_states)
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        return hidden_states

    def decode_cached(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Sequence[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: Sequence[KeyValueCache],
    ) -> torch.Tensor:
        """``forward`` of new tokens over each layer's KV cache (incremental decoding, no gradients
        needed), the final norm included: each layer's last residual add is left to the next
        layer's input norm or the final norm, which adds it in its own kernel
        (``DecoderLayer.decode_deferred``).

        Args:
            hidden_states: ``(batch, new, hidden)`` embedded new tokens.
            position_embeddings: Each layer's ``(cos, sin)`` tables (``position_embeddings``).
            kv_caches: Each layer's cache, in ``decoder_layers`` order.
        """
        if self.norm is None:
            raise RuntimeError("decode_cached needs the final norm (the last pipeline stage)")
        layers = self.decoder_layers()
        stream, branch = hidden_states, None
        for layer, tables, cache in zip(layers, position_embeddings, kv_caches, strict=True):
            stream, branch = layer.decode_deferred(stream, branch, tables, cache)
        if branch is None:
            return self.norm(stream)
        return self.norm.add_and_normalize(stream, branch)[1]
