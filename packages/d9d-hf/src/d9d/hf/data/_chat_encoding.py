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
    (so the assistant header is not learned; where the generation prompt holds more than the
    conversation does at that point, as Qwen3's empty think block without thinking, after the
    part that it holds) and ends where the conversation up to it ends (so
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
        start = _turn_start(template, messages, i, full, variables=variables)
        last = i == len(messages) - 1
        upto = full if last else template.render(messages[: i + 1], variables=variables)
        if full.startswith(upto):
            spans.append((start, len(upto)))
            continue
        content = str(message.get("content") or "")
        found = full.find(content, start)
        at = upto.rfind(content)
        if not content or found < 0 or at < 0:
            raise ChatTemplateError(
                f"message {i}: the assistant content is not found in the rendered conversation"
            )
        end = found + len(content)
        closing = upto[at + len(content) :]
        if full.startswith(closing, end):
            end += len(closing)
        spans.append((start, end))
    return full, spans


def _turn_start(
    template: ChatTemplate,
    messages: Sequence[Message],
    i: int,
    full: str,
    *,
    variables: Mapping[str, Any] | None,
) -> int:
    """Where assistant message ``i``'s learned text starts in ``full``.

    That is where the conversation before it, rendered with the generation prompt, ends. A
    template may put more in the generation prompt than in the same turn once later turns follow:
    Qwen3 without thinking prompts with an empty ``<think></think>`` block but renders earlier
    answers without one. Then the turn starts after the longest part of the generation prompt
    that the whole conversation holds there (the assistant header): what a prompt for generation
    would give the model is not learned, whatever follows is.
    """
    before = template.render(messages[:i], add_generation_prompt=True, variables=variables)
    if full.startswith(before):
        return len(before)
    plain = template.render(messages[:i], variables=variables)
    if not (before.startswith(plain) and full.startswith(plain)):
        raise ChatTemplateError(
            f"message {i}: the conversation before it, rendered with or without the generation prompt, "
            "is not a prefix of the whole conversation: this template cannot be split into turns"
        )
    prompt = before[len(plain) :]
    rest = full[len(plain) : len(plain) + len(prompt)]
    held = next((k for k, (a, b) in enumerate(zip(prompt, rest, strict=False)) if a != b), len(rest))
    if held == 0:
        raise ChatTemplateError(
            f"message {i}: the whole conversation holds none of the generation prompt {prompt!r} where the "
            "turn starts: this template cannot be split into turns"
        )
    return len(plain) + held


def encode_chat(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    *,
    variables: Mapping[str, Any] | None = None,
    learn_from: int = 0,
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a conversation: labels are the ids on assistant turns, else -100.

    The text is tokenized as a whole without adding special tokens (the template writes them),
    as ``apply_chat_template(..., tokenize=True)`` does, so ``input_ids`` equal transformers'.
    A token belongs to a turn when it starts inside the turn's span.

    Args:
        template: The chat template.
        tokenizer: The checkpoint's tokenizer.
        messages: The conversation.
        variables: Extra template variables.
        learn_from: Only assistant turns at this message index or later are learned (a
            preference pair's completion after a prompt that holds assistant turns itself).
    """
    text, all_spans = assistant_spans(template, messages, variables=variables)
    learned = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    spans = [span for i, span in zip(learned, all_spans, strict=True) if i >= learn_from]
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
