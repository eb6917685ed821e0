"""How a record's fields become text: a chat, a prompt and completion, or plain text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChatTemplateOptions(_Strict):
    """How conversations are rendered (shared by the chat formats of SFT and preference data).

    Attributes:
        system_prompt: A system message put first where a conversation has none.
        template: A ``.jinja`` file to use instead of the checkpoint's ``chat_template``.
        variables: Extra template variables (``{enable_thinking: false}``).
    """

    system_prompt: str | None = None
    template: Path | None = None
    variables: dict[str, Any] = Field(default_factory=dict[str, Any])

    @field_validator("template")
    @classmethod
    def _template_exists(cls, template: Path | None) -> Path | None:
        # Refused at load, with the key, not when the data is first encoded.
        if template is not None and not template.is_file():
            raise ValueError(f"template file {template} does not exist")
        return template


class ChatFormatConfig(ChatTemplateOptions):
    """A conversation rendered with the checkpoint's chat template; loss on assistant turns only.

    Attributes:
        messages_field: The record's list of ``{"role": ..., "content": ...}`` messages.
        system_prompt: A system message put first where a conversation has none.
        template: A ``.jinja`` file to use instead of the checkpoint's ``chat_template``.
        variables: Extra template variables (``{enable_thinking: false}``).
    """

    kind: Literal["chat"] = "chat"
    messages_field: str = "messages"


class PromptCompletionFormatConfig(_Strict):
    """``prompt`` then ``separator + completion`` then the end-of-sequence token; loss on the completion.

    Attributes:
        prompt_field: The record's prompt.
        completion_field: The record's completion.
        separator: Put before the completion (tokenized with it).
    """

    kind: Literal["prompt_completion"] = "prompt_completion"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    separator: str = " "


class TextFormatConfig(_Strict):
    """Plain text then the end-of-sequence token; loss on every token (continued pre-training).

    Attributes:
        text_field: The record's text.
    """

    kind: Literal["text"] = "text"
    text_field: str = "text"


def _from_shorthand(value: Any) -> Any:
    return {"kind": value} if isinstance(value, str) else value


FormatConfig = Annotated[
    Annotated[
        ChatFormatConfig | PromptCompletionFormatConfig | TextFormatConfig, Field(discriminator="kind")
    ],
    BeforeValidator(_from_shorthand),
]
"""One of the formats by ``kind``; a bare ``chat``, ``prompt_completion`` or ``text`` means its defaults."""
