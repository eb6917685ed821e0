"""Records to token rows by the configured format (a ``SampleEncoder`` for d9d-loop's data provider)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from tokenizers import Tokenizer

from d9d.hf.data._chat_encoding import IGNORE_INDEX, encode_chat
from d9d.hf.data._chat_template import ChatTemplate, ChatTemplateError, Message
from d9d.hf.data._format_config import ChatFormatConfig, PromptCompletionFormatConfig, TextFormatConfig
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


class SFTEncoder:
    """Encodes records as the format says, with the checkpoint's tokenizer and chat template.

    Args:
        files: The tokenizer directory's files.
        format: The record format.
        eos_id: Appended after prompt/completion and text samples.
        pad_id: Padding's token id.

    The chat format's template is the format's own `template` file when set, otherwise the
    tokenizer directory's.
    """

    def __init__(
        self,
        *,
        files: TokenizerFiles,
        format: ChatFormatConfig | PromptCompletionFormatConfig | TextFormatConfig,
        eos_id: int,
        pad_id: int,
    ) -> None:
        self._tokenizer: Tokenizer = files.tokenizer
        self._format = format
        self._eos = eos_id
        self._pad = pad_id
        self._template: ChatTemplate | None = None
        if isinstance(format, ChatFormatConfig):
            override = None if format.template is None else format.template.read_text()
            self._template = files.template(override)

    @property
    def pad_id(self) -> int:
        return self._pad

    def _ids(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode(self, record: Record) -> TokenRow:
        """The record's tokens and labels (see the format configs).

        Raises:
            SampleError: On a missing or mistyped field, or a template that fails, naming the record.
        """
        match self._format:
            case ChatFormatConfig():
                assert self._template is not None  # built in __init__ for this format
                messages = _messages(record, self._format.messages_field)
                if self._format.system_prompt is not None and messages[0].get("role") != "system":
                    messages = [{"role": "system", "content": self._format.system_prompt}, *messages]
                try:
                    ids, labels = encode_chat(
                        self._template, self._tokenizer, messages, variables=self._format.variables
                    )
                except ChatTemplateError as e:
                    raise SampleError(f"{record.where}: {e}") from e
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
