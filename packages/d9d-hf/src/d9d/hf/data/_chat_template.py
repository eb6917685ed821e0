"""Chat templates rendered with jinja2 as transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]

# A message's reasoning goes by several names; templates read ``reasoning_content`` (gpt-oss: ``thinking``).
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template failed to compile or to render; the message says which and why."""


def _raise_exception(message: str) -> str:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not expect
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _with_reasoning_names(message: Message) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_NAMES if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A checkpoint's ``chat_template``, compiled once in a sandbox.

    The environment is the one transformers uses (sandboxed, ``trim_blocks``, ``lstrip_blocks``,
    loop controls, a ``tojson`` that keeps non-ASCII and HTML characters, ``raise_exception``,
    ``strftime_now``), and the template sees what it sees there: ``messages``,
    ``add_generation_prompt``, ``tools`` and ``documents`` (None), the special tokens
    (``bos_token``, ``eos_token``, ...) and any extra variables (``enable_thinking``, say).

    Args:
        source: The template text.
        special_tokens: The tokenizer's special tokens by name (``{"eos_token": "<|im_end|>"}``).

    Raises:
        ChatTemplateError: If the template does not compile.
    """

    def __init__(self, source: str, *, special_tokens: Mapping[str, str]) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        try:
            self._template = environment.from_string(
                source, globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now}
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as text.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts (system, user, assistant, tool).
            add_generation_prompt: End with the header of an assistant turn (for generation).
            variables: Extra template variables; they override special tokens of the same name.

        Raises:
            ChatTemplateError: If rendering fails (the template's ``raise_exception`` included).
        """
        try:
            return self._template.render(
                messages=[_with_reasoning_names(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special_tokens, **(variables or {})},
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from e
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from e
