"""A conversation to tokens, with labels on the assistant turns only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from d9d.hf.data._chat_template import ChatTemplate, ChatTemplateError, Message

IGNORE_INDEX = -100


def assistant_spans(
    template: ChatTemplate, messages: Sequence[Message], *, variables: Mapping[str, Any] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    A turn starts where the conversation before it, rendered with the generation prompt, ends
    (so the assistant header is not learned) and ends where the conversation up to it ends (so
    the end-of-turn token is learned). Templates that render an earlier turn differently once
    later turns follow (Qwen3 drops empty think blocks of earlier turns) are handled by finding
    the turn's content after its start, then the template's text that closes the turn.

    Raises:
        ChatTemplateError: If the template renders a prefix that is not one, or a turn's content
            cannot be found in the rendered text.
    """
    full = template.render(messages, variables=variables)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, variables=variables)
        if not full.startswith(before):
            raise ChatTemplateError(
                f"message {i}: the conversation before it, rendered with the generation prompt, is not a "
                "prefix of the whole conversation: this template cannot be split into turns"
            )
        last = i == len(messages) - 1
        upto = full if last else template.render(messages[: i + 1], variables=variables)
        if full.startswith(upto):
            spans.append((len(before), len(upto)))
            continue
        content = str(message.get("content") or "")
        found = full.find(content, len(before))
        at = upto.rfind(content)
        if not content or found < 0 or at < 0:
            raise ChatTemplateError(
                f"message {i}: the assistant content is not found in the rendered conversation"
            )
        end = found + len(content)
        closing = upto[at + len(content) :]
        if full.startswith(closing, end):
            end += len(closing)
        spans.append((len(before), end))
    return full, spans


def encode_chat(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    *,
    variables: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a conversation: labels are the ids on assistant turns, else -100.

    The text is tokenized as a whole without adding special tokens (the template writes them),
    as ``apply_chat_template(..., tokenize=True)`` does, so ``input_ids`` equal transformers'.
    A token belongs to a turn when it starts inside the turn's span.
    """
    text, spans = assistant_spans(template, messages, variables=variables)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = list(encoding.ids)
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for t, (start, _end) in enumerate(encoding.offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span < len(spans) and spans[span][0] <= start < spans[span][1]:
            labels[t] = ids[t]
    return ids, labels
