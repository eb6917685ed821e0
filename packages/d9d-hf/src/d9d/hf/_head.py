"""The heads a Hugging Face decoder can carry in d9d."""

from __future__ import annotations

from typing import Literal

HeadName = Literal["causal_lm", "sequence_classification", "embedding"]
"""``causal_lm``: next-token loss and logits; ``sequence_classification``: one logit vector per row
(last non-padding token, as transformers' ``*ForSequenceClassification``); ``embedding``: one
L2-normalized vector per row (last-token pooling, as Qwen3-Embedding)."""
