"""Tokenizer-bound data: chat templates as transformers renders them, record formats, the SFT provider."""

from d9d.hf.data._chat_encoding import assistant_spans, encode_chat
from d9d.hf.data._chat_template import ChatTemplate, ChatTemplateError, Message
from d9d.hf.data._config import SFTDataConfig
from d9d.hf.data._encoder import SFTEncoder
from d9d.hf.data._format_config import (
    ChatFormatConfig,
    FormatConfig,
    PromptCompletionFormatConfig,
    TextFormatConfig,
)
from d9d.hf.data._provider import sft_data_provider, token_batch
from d9d.hf.data._tokenizer_files import TokenizerFiles, TokenizerFilesError

__all__ = [
    "ChatFormatConfig",
    "ChatTemplate",
    "ChatTemplateError",
    "FormatConfig",
    "Message",
    "PromptCompletionFormatConfig",
    "SFTDataConfig",
    "SFTEncoder",
    "TextFormatConfig",
    "TokenizerFiles",
    "TokenizerFilesError",
    "assistant_spans",
    "encode_chat",
    "sft_data_provider",
    "token_batch",
]
