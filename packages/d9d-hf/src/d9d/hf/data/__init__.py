"""Tokenizer-bound data: chat templates as transformers renders them, record formats, the SFT provider,
preference pairs."""

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
from d9d.hf.data._preference_config import (
    PreferenceChatFormatConfig,
    PreferenceDataConfig,
    PreferenceFormatConfig,
    PreferenceTextFormatConfig,
)
from d9d.hf.data._preference_encoder import PreferenceEncoder, PreferencePair
from d9d.hf.data._preference_reader import PreferenceData, load_preference_pairs, read_preference_pairs
from d9d.hf.data._provider import sft_data_provider, token_batch
from d9d.hf.data._tokenizer_files import TokenizerFiles, TokenizerFilesError

__all__ = [
    "ChatFormatConfig",
    "ChatTemplate",
    "ChatTemplateError",
    "FormatConfig",
    "Message",
    "PreferenceChatFormatConfig",
    "PreferenceData",
    "PreferenceDataConfig",
    "PreferenceEncoder",
    "PreferenceFormatConfig",
    "PreferencePair",
    "PreferenceTextFormatConfig",
    "PromptCompletionFormatConfig",
    "SFTDataConfig",
    "SFTEncoder",
    "TextFormatConfig",
    "TokenizerFiles",
    "TokenizerFilesError",
    "assistant_spans",
    "encode_chat",
    "load_preference_pairs",
    "read_preference_pairs",
    "sft_data_provider",
    "token_batch",
]
