"""The ``dataset`` section of a fine-tuning job: d9d-loop's token data plus the record format."""

from __future__ import annotations

from d9d.hf.data._format_config import ChatFormatConfig, FormatConfig
from d9d.loop.data import TokenDataConfig


class SFTDataConfig(TokenDataConfig):
    """Where samples come from, their format, and how they become rows.

    ``{source: data/chat.jsonl, format: chat, packing: true, sequence_length: 4096}``; see
    ``TokenDataConfig`` for the rest.

    Attributes:
        format: ``chat`` (default), ``prompt_completion`` or ``text``, or the full form
            (``{kind: chat, messages_field: conversation, system_prompt: ...}``).
    """

    format: FormatConfig = ChatFormatConfig()
