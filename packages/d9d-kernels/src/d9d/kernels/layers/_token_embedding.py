"""Token embedding table."""

from __future__ import annotations

from torch import nn

from d9d.kernels.layers._init import init_normal_


class TokenEmbedding(nn.Embedding):
    """An ``nn.Embedding`` with a truncated-normal initialization.

    It stays an ``nn.Embedding`` so PyTorch's tensor-parallel styles (vocabulary-sharded rowwise or
    hidden-sharded colwise) apply to it unchanged.

    Args:
        vocab_size: Number of tokens.
        hidden_size: Embedding width.
        init_std: Standard deviation of the truncated-normal initialization.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, init_std: float = 0.02) -> None:
        self.init_std = init_std
        super().__init__(vocab_size, hidden_size)

    def reset_parameters(self) -> None:
        """Truncated-normal weights."""
        init_normal_(self.weight, self.init_std)
