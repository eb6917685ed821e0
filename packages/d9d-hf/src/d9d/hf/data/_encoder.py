"""Records to token rows by the configured format (a ``SampleEncoder`` for d9d-loop's data provider)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel
from tokenizers import Tokenizer

from d9d.hf.data._chat_encoding import IGNORE_INDEX, encode_chat
from d9d.hf.data._chat_template import ChatTemplate, ChatTemplateError, Message
from d9d.hf.data._format_config import (
    ChatFormatConfig,
    ChatTemplateOptions,
    PromptCompletionFormatConfig,
    TextFormatConfig,
)
from d9d.hf.data._tokenizer_files import TokenizerFiles
from d9d.loop.data import Record, SampleError, TokenRow


def _text(record: Record, field: str) -> str:
    value = record.fields.get(field)
    if value is None:
        raise SampleError(f"{record.where}: missing field '{field}' (has {sorted(record.fields)})")
    if not isinstance(value, str):
        raise SampleError(f"{record.where}: field '{field}' must be text, got {type(value).__name__}")
    return value


def message_list(value: Any, *, where: str, field: str) -> list[Message]:
    """``value`` as a non-empty list of ``{role, content}`` messages.

    Raises:
        SampleError: If it is not one, naming ``where`` and ``field`` (and the bad item).
    """
    if not isinstance(value, list) or not value:
        raise SampleError(f"{where}: field '{field}' must be a non-empty list of messages")
    messages: list[Message] = []
    for i, item in enumerate(cast(list[Any], value)):
        if not isinstance(item, dict) or "role" not in item:
            raise SampleError(f"{where}: {field}[{i}] is not a {{role, content}} message")
        messages.append(cast(Mapping[str, Any], item))
    return messages


def _messages(record: Record, field: str) -> list[Message]:
    return message_list(record.fields.get(field), where=record.where, field=field)


class ChatEncoder:
    """Conversations to ids and labels through the checkpoint's chat template and a format's options.

    Args:
        files: The tokenizer directory's files.
        options: The format's system prompt, template file (else the tokenizer directory's) and
            template variables.
    """

    def __init__(self, files: TokenizerFiles, options: ChatTemplateOptions) -> None:
        self._tokenizer: Tokenizer = files.tokenizer
        self._options = options
        override = None if options.template is None else options.template.read_text()
        self._template: ChatTemplate = files.template(override)

    def with_system_prompt(self, messages: list[Message]) -> list[Message]:
        """``messages`` led by the options' system prompt, where one is set and they have none."""
        if self._options.system_prompt is not None and messages[0].get("role") != "system":
            return [{"role": "system", "content": self._options.system_prompt}, *messages]
        return messages

    def encode(
        self, messages: list[Message], *, where: str, learn_from: int = 0
    ) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of ``messages`` (see ``encode_chat``).

        Raises:
            SampleError: If the template fails, its message prefixed by ``where``.
        """
        try:
            return encode_chat(
                self._template,
                self._tokenizer,
                messages,
                variables=self._options.variables,
                learn_from=learn_from,
            )
        except ChatTemplateError as e:
            raise SampleError(f"{where}: {e}") from e


_Format = TypeVar("_Format", bound=BaseModel)


class FormatEncoder(Generic[_Format]):
    """A record encoder's state: tokenizer, format, eos and pad ids, and a chat format's ``ChatEncoder``.

    The ``ChatEncoder`` is built only when the format is a ``ChatTemplateOptions``.

    Args:
        files: The tokenizer directory's files.
        format: The record format.
        eos_id: The end-of-sequence token id.
        pad_id: Padding's token id.
    """

    def __init__(self, *, files: TokenizerFiles, format: _Format, eos_id: int, pad_id: int) -> None:
        self._tokenizer: Tokenizer = files.tokenizer
        self._format = format
        self._eos = eos_id
        self._pad = pad_id
        self._chat_encoder = ChatEncoder(files, format) if isinstance(format, ChatTemplateOptions) else None

    @property
    def pad_id(self) -> int:
        """Padding's token id."""
        return self._pad

    def _ids(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


class SFTEncoder(FormatEncoder[ChatFormatConfig | PromptCompletionFormatConfig | TextFormatConfig]):
    """Encodes records as the format says, with the checkpoint's tokenizer and chat template.

    Args:
        files: The tokenizer directory's files.
        format: The record format.
        eos_id: Appended after prompt/completion and text samples.
        pad_id: Padding's token id.

    The chat format's template is the format's own `template` file when set, otherwise the
    tokenizer directory's.
    """

    def encode(self, record: Record) -> TokenRow:
        """The record's tokens and labels (see the format configs).

        Raises:
            SampleError: On a missing or mistyped field, or a template that fails, naming the record.
        """
        match self._format:
            case ChatFormatConfig():
                assert self._chat_encoder is not None  # built in __init__ for this format
                messages = self._chat_encoder.with_system_prompt(
                    _messages(record, self._format.messages_field)
                )
                ids, labels = self._chat_encoder.encode(messages, where=record.where)
            case PromptCompletionFormatConfig():
                prompt = self._ids(_text(record, self._format.prompt_field))
                completion = [
                    *self._ids(self._format.separator + _text(record, self._format.completion_field)),
                    self._eos,
                ]
                ids, labels = prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
            case TextFormatConfig():
                ids = [*self._ids(_text(record, self._format.text_field)), self._eos]
                labels = list(ids)
        if not any(label != IGNORE_INDEX for label in labels):
            raise SampleError(f"{record.where}: the sample has no token to learn (no assistant turn?)")
        return TokenRow(input_ids=ids, labels=labels, where=record.where)
