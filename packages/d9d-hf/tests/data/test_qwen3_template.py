"""Qwen3's own chat template, with and without thinking: ids equal transformers', loss on answers only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from d9d.hf.data import ChatFormatConfig, ChatTemplate, SFTEncoder, TokenizerFiles, encode_chat
from d9d.loop.data import Record, RecordPosition

# The chat_template of Qwen/Qwen3-0.6B's tokenizer_config.json, as it ships.
QWEN3 = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
SPECIAL_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

MULTI_TURN: list[dict[str, Any]] = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "capital of peru ?"},
    {"role": "assistant", "content": "lima"},
    {"role": "user", "content": "and of france ?"},
    {"role": "assistant", "content": "paris"},
    {"role": "user", "content": "and of österreich ?"},
    {"role": "assistant", "content": "vienna"},
]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    # three answers after a system prompt
    "multi_turn": MULTI_TURN,
    # two answers, no system prompt
    "two_turns": MULTI_TURN[1:5],
    # one answer
    "one_turn": MULTI_TURN[1:3],
    # the last answer carries its reasoning
    "reasoning": [
        *MULTI_TURN[1:4],
        {"role": "assistant", "content": "paris", "reasoning_content": "it is paris"},
    ],
}
# template variables as a job's ``format.variables`` would pass them (None: not set)
THINKING: dict[str, bool | None] = {"default": None, "thinking_on": True, "thinking_off": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE with Qwen3's chat tokens (<think> and </think> as added, non-special tokens)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = ["answer briefly capital of peru lima and of france paris österreich vienna it is"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return tokenizer


def _variables(thinking: bool | None) -> dict[str, Any]:
    return {} if thinking is None else {"enable_thinking": thinking}


def _ids(value: Any) -> list[int]:
    return list(value["input_ids"]) if hasattr(value, "keys") else list(value)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", sorted(THINKING))
def test_ids_equal_transformers_and_the_loss_falls_on_the_answers(
    tokenizer: Tokenizer, conversation: str, thinking: str
) -> None:
    messages = CONVERSATIONS[conversation]
    variables = _variables(THINKING[thinking])
    reference = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=QWEN3, **SPECIAL_TOKENS)
    template = ChatTemplate(QWEN3, special_tokens=SPECIAL_TOKENS)

    ids, labels = encode_chat(template, tokenizer, messages, variables=variables)

    assert ids == _ids(reference.apply_chat_template(messages, tokenize=True, **variables))
    text = template.render(messages, variables=variables)
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    learned = "".join(text[a:b] for (a, b), label in zip(offsets, labels, strict=True) if label != -100)
    # what the model would generate after each turn's generation prompt, and nothing else
    answers = [m for m in messages if m["role"] == "assistant"]
    expected = ""
    for i, answer in enumerate(answers):
        last = i == len(answers) - 1
        if last and "reasoning_content" in answer:
            # thinking off prompts with "<think>\n" too: what the prompt would give is not learned
            opening = "" if THINKING[thinking] is False else "<think>\n"
            expected += f"{opening}{answer['reasoning_content']}\n</think>\n\n"
        elif last and THINKING[thinking] is not False:
            # thinking on: the model writes the (here empty) think block itself
            expected += "<think>\n\n</think>\n\n"
        # thinking off: the empty think block is the generation prompt's, not learned
        expected += f"{answer['content']}<|im_end|>\n"
    assert learned == expected


def test_a_job_without_thinking_encodes_every_multi_turn_sample(tokenizer: Tokenizer, tmp_path: Path) -> None:
    # format.variables: {enable_thinking: false} once dropped every multi-turn sample as bad
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {**SPECIAL_TOKENS, "chat_template": QWEN3}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    files = TokenizerFiles.load(tmp_path)
    format = ChatFormatConfig(variables={"enable_thinking": False})
    encoder = SFTEncoder(files=files, format=format, eos_id=2, pad_id=0)

    row = encoder.encode(
        Record(fields={"messages": MULTI_TURN}, where="chat.jsonl:1", next=RecordPosition(index=1))
    )

    reference = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=QWEN3, **SPECIAL_TOKENS)
    assert row.input_ids == _ids(
        reference.apply_chat_template(MULTI_TURN, tokenize=True, enable_thinking=False)
    )
    assert sum(label != -100 for label in row.labels) > 0
