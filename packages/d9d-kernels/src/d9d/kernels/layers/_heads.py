"""Output heads: language modelling, sequence classification and embeddings."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from d9d.kernels import linear_cross_entropy
from d9d.kernels.layers._init import init_linear_, init_normal_
from d9d.kernels.layers._pooling import Pooling, pool_hidden_states


class LanguageModelHead(nn.Module):
    """Vocabulary projection whose training forward returns per-token losses, never logits.

    ``forward`` runs the fused, chunked linear cross-entropy, so the ``(tokens, vocab)`` logits are
    not materialized; ``compute_logits`` gives logits for inference. The weight is ``(vocab, hidden)``
    and can be tied to a ``TokenEmbedding`` by assigning that module's weight.

    Args:
        hidden_size: Model width.
        vocab_size: Vocabulary size.
        ignore_index: Label that contributes no loss (loss 0 at that token).
        init_std: Standard deviation of the truncated-normal initialization.
        logit_scale: Multiplies every logit (applied to the hidden states before the projection,
            so the fused loss needs no logits); 1 leaves them as they are.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        ignore_index: int = -100,
        init_std: float = 0.02,
        logit_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.init_std = init_std
        self.logit_scale = logit_scale
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated-normal weight."""
        init_normal_(self.weight, self.init_std)

    def forward(
        self, hidden_states: torch.Tensor, labels: torch.Tensor, *, uniform_upstream_gradient: bool = False
    ) -> torch.Tensor:
        """Per-token cross-entropy losses.

        Args:
            hidden_states: ``(..., hidden_size)``.
            labels: Integer targets with the leading shape of ``hidden_states`` (already shifted).
            uniform_upstream_gradient: The caller reduces the losses with one weight for every
                target token (a sum, or a mean over targets): the gradients are then computed in
                the forward and no logits are recomputed in the backward (see
                ``linear_cross_entropy``). Leave False when tokens are weighted differently.

        Returns:
            fp32 losses with the shape of ``labels``; 0 where ``labels == ignore_index``.
        """
        if hidden_states.shape[:-1] != labels.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} != leading shape of hidden_states "
                f"{tuple(hidden_states.shape[:-1])}"
            )
        losses = linear_cross_entropy(
            self._scaled(hidden_states).reshape(-1, hidden_states.shape[-1]),
            self.weight,
            labels.reshape(-1).to(torch.int64),
            ignore_index=self.ignore_index,
            reduction="none",
            uniform_upstream_gradient=uniform_upstream_gradient,
        )
        return losses.reshape(labels.shape)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``(..., vocab_size)`` in the hidden states' dtype (for inference)."""
        return functional.linear(self._scaled(hidden_states), self.weight)

    def _scaled(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if self.logit_scale == 1.0 else hidden_states * self.logit_scale

    def extra_repr(self) -> str:
        scale = "" if self.logit_scale == 1.0 else f", logit_scale={self.logit_scale}"
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}{scale}"


class ClassificationHead(nn.Module):
    """Pools each sequence and maps it to class logits.

    Args:
        hidden_size: Model width.
        num_labels: Number of classes.
        pooling: Which tokens represent the sequence (``"last"`` suits causal models).
        bias: Bias on the classifier.
        init_std: Standard deviation of the truncated-normal initialization.
    """

    def __init__(
        self,
        hidden_size: int,
        num_labels: int,
        *,
        pooling: Pooling = "last",
        bias: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.pooling: Pooling = pooling
        self.init_std = init_std
        self.classifier = nn.Linear(hidden_size, num_labels, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated-normal weight, zero bias."""
        init_linear_(self.classifier, self.init_std)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Maps ``(batch, seq, hidden_size)`` (with an optional ``(batch, seq)`` padding mask) to
        ``(batch, num_labels)`` logits."""
        pooled = pool_hidden_states(hidden_states, self.pooling, attention_mask=attention_mask)
        return self.classifier(pooled)


class EmbeddingHead(nn.Module):
    """Pools each sequence into an embedding, optionally projected and L2-normalized.

    Args:
        hidden_size: Model width.
        pooling: Which tokens represent the sequence.
        normalize: L2-normalize the output (for cosine-similarity retrieval).
        output_size: Size of a learned projection after pooling; None keeps the pooled vector.
        init_std: Standard deviation of the projection's truncated-normal initialization.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        pooling: Pooling = "mean",
        normalize: bool = True,
        output_size: int | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.pooling: Pooling = pooling
        self.normalize = normalize
        self.init_std = init_std
        self.projection = nn.Linear(hidden_size, output_size, bias=False) if output_size is not None else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated-normal projection (if any)."""
        if self.projection is not None:
            init_linear_(self.projection, self.init_std)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Maps ``(batch, seq, hidden_size)`` to ``(batch, output_size or hidden_size)`` embeddings."""
        embedding = pool_hidden_states(hidden_states, self.pooling, attention_mask=attention_mask)
        if self.projection is not None:
            embedding = self.projection(embedding)
        if self.normalize:
            embedding = functional.normalize(embedding.to(torch.float32), dim=-1).to(embedding.dtype)
        return embedding
