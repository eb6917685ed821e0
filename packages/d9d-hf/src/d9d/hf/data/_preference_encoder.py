"""Preference records to token pairs: the prompt with each answer, labels on the answer only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from d9d.hf.data._chat_encoding import IGNORE_INDEX
from d9d.hf.data._chat_template import Message
from d9d.hf.data._encoder import FormatEncoder, message_list
from d9d.hf.data._preference_config import PreferenceChatFormatConfig, PreferenceTextFormatConfig
from d9d.loop.data import Record, SampleError, TokenRow


@dataclass(kw_only=True)
class PreferencePair:
    """One preference row as tokens.

    Attributes:
        chosen: The prompt and the preferred answer; labels on the answer's tokens only.
        rejected: The prompt and the dispreferred answer, labelled the same way.
        index: The row's index in the source (0-based), for messages and to key reference scores.
    """

    chosen: TokenRow
    rejected: TokenRow
    index: int


def _messages(value: Any, *, role: str, where: str, key: str) -> list[Message]:
    """A string as one message of ``role``, else a non-empty list of ``{role, content}`` messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return message_list(value, where=where, field=key)


class PreferenceEncoder(FormatEncoder[PreferenceChatFormatConfig | PreferenceTextFormatConfig]):
    """Encodes preference records as the format says, with the checkpoint's tokenizer and template.

    Args:
        files: The tokenizer directory's files.
        format: The record format.
        eos_id: Appended after each answer of the text format.
        pad_id: Padding's token id.
    """

    def encode(self, record: Record, index: int) -> PreferencePair:
        """The row's two sequences.

        Raises:
            SampleError: If the prompt, chosen or rejected field is missing (naming the row's index
                and the key), mistyped, or an answer has no token to learn.
        """
        where = f"row {index} ({record.where})"
        fmt = self._format
        for key in (fmt.prompt_field, fmt.chosen_field, fmt.rejected_field):
            if record.fields.get(key) is None:
                raise SampleError(f"{where}: missing key '{key}' (the row has {sorted(record.fields)})")
        prompt = record.fields[fmt.prompt_field]
        sides = [
            self._side(prompt, record.fields[key], where=where, key=key)
            for key in (fmt.chosen_field, fmt.rejected_field)
        ]
        return PreferencePair(chosen=sides[0], rejected=sides[1], index=index)

    def _side(self, prompt: Any, answer: Any, *, where: str, key: str) -> TokenRow:
        match self._format:
            case PreferenceChatFormatConfig() as fmt:
                ids, labels = self._chat(fmt, prompt, answer, where=where, key=key)
            case PreferenceTextFormatConfig() as fmt:
                if not isinstance(prompt, str) or not isinstance(answer, str):
                    raise SampleError(
                        f"{where}: the text format needs a text '{fmt.prompt_field}' and '{key}'"
                    )
                head = self._ids(prompt)
                tail = [*self._ids(fmt.separator + answer), self._eos]
                ids, labels = head + tail, [IGNORE_INDEX] * len(head) + tail
        if all(label == IGNORE_INDEX for label in labels):
            raise SampleError(f"{where}: '{key}' has no token to learn (no assistant turn?)")
        return TokenRow(input_ids=ids, labels=labels, where=where)

    def _chat(
        self, fmt: PreferenceChatFormatConfig, prompt: Any, answer: Any, *, where: str, key: str
    ) -> tuple[list[int], list[int]]:
        assert self._chat_encoder is not None  # built in __init__ for this format
        before = self._chat_encoder.with_system_prompt(
            _messages(prompt, role="user", where=where, key=fmt.prompt_field)
        )
        after = _messages(answer, role="assistant", where=where, key=key)
        return self._chat_encoder.encode([*before, *after], where=f"{where}: '{key}'", learn_from=len(before))
