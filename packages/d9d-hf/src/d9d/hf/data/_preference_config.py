"""The ``dataset`` section of a preference job (DPO): rows of a prompt, a chosen and a rejected answer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from d9d.hf.data._format_config import ChatTemplateOptions
from d9d.loop.data import DataSourceConfig, OverlongPolicy


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PreferenceChatFormatConfig(ChatTemplateOptions):
    """Prompt and answers as conversations, rendered with the checkpoint's chat template.

    ``prompt`` is a list of messages (or a string: one user message); ``chosen`` and
    ``rejected`` are the messages that follow it (or a string: one assistant message). Each
    answer is rendered after the prompt; the loss falls on the answer's assistant turns only.

    Attributes:
        prompt_field: The record's prompt.
        chosen_field: The record's preferred answer.
        rejected_field: The record's dispreferred answer.
        system_prompt: A system message put first where a prompt has none.
        template: A ``.jinja`` file to use instead of the checkpoint's ``chat_template``.
        variables: Extra template variables (``{enable_thinking: false}``).
    """

    kind: Literal["chat"] = "chat"
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"


class PreferenceTextFormatConfig(_Strict):
    """Plain text: ``prompt`` then ``separator + answer`` then end-of-sequence; loss on the answer.

    Attributes:
        prompt_field: The record's prompt.
        chosen_field: The record's preferred answer.
        rejected_field: The record's dispreferred answer.
        separator: Put before each answer (tokenized with it).
    """

    kind: Literal["text"] = "text"
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    separator: str = " "


def _from_shorthand(value: Any) -> Any:
    return {"kind": value} if isinstance(value, str) else value


PreferenceFormatConfig = Annotated[
    Annotated[PreferenceChatFormatConfig | PreferenceTextFormatConfig, Field(discriminator="kind")],
    BeforeValidator(_from_shorthand),
]
"""One of the preference formats by ``kind``; a bare ``chat`` or ``text`` means its defaults."""


class PreferenceDataConfig(_Strict):
    """Where preference rows come from and how they become token pairs.

    ``{source: data/pairs.jsonl, format: chat, sequence_length: 1024}``. Every row is read and
    checked when the data is built, before the first step: a row without its prompt, chosen or
    rejected field stops the job naming the row's index and the missing key.

    Attributes:
        source: A ``.jsonl`` / ``.parquet`` path, or ``{kind: jsonl|parquet|hf_datasets, ...}``.
        format: ``chat`` (default) or ``text``, or the full form.
        sequence_length: Tokens of the longest prompt + answer kept.
        overlong: A pair with a side longer than ``sequence_length`` is cut (``truncate``: both
            sides to ``sequence_length``; a side left with no answer token drops the pair) or
            left out (``drop``); either is counted and logged.
    """

    source: DataSourceConfig
    format: PreferenceFormatConfig = PreferenceChatFormatConfig()
    sequence_length: int = Field(ge=2)
    overlong: OverlongPolicy = "truncate"
