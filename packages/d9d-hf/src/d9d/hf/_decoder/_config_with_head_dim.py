"""The decoder config base with config.json's optional ``head_dim``, shared by the families that have it."""

from __future__ import annotations

from d9d.hf._decoder._config_base import DecoderConfigBase


class DecoderConfigWithHeadDim(DecoderConfigBase):
    """``DecoderConfigBase`` with config.json's optional ``head_dim`` (Llama's, Mistral's, ...).

    A family whose transformers config has the field subclasses this instead of
    ``DecoderConfigBase``; a family without it keeps ``hidden_size // num_attention_heads`` and
    refuses the field as unknown.
    """

    head_dim: int | None = None

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim``, else ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads
