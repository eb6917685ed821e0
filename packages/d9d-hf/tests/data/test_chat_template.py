# ruff: noqa: E501  (chat templates are kept one statement per line, as they ship)
"""Chat templates render, and tokenize, exactly as transformers' apply_chat_template does."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from d9d.hf.data import ChatTemplate, ChatTemplateError, encode_chat

SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|begin_of_text|>", "<|eot_id|>", "<unk>"]
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

# ChatML, as Qwen2 ships it: a default system prompt when the conversation has none.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3 style: a bos token, headers, trimmed content, and the namespace/loop controls.
LLAMA3 = (
    "{{- bos_token }}{% set ns = namespace(n=0) %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral style: [INST] blocks, raise_exception on an out-of-order role, eos after each answer.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# Qwen3 style: think blocks on the answer after the last user turn only, tojson of a dict.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1, found=false) %}"
    "{%- for message in messages[::-1] %}{%- set i = messages|length - 1 - loop.index0 %}"
    "{%- if message.role == 'user' and not ns.found %}{%- set ns.last_query = i %}{%- set ns.found = true %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
    "{%- if loop.index0 > ns.last_query %}{{- '<think>\n' + (message.reasoning_content or '') + '\n</think>\n\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "qwen3_like": QWEN3_LIKE}

CONVERSATIONS: list[list[dict[str, Any]]] = [
    # one turn, no system prompt
    [
        {"role": "user", "content": "what is the capital of france ?"},
        {"role": "assistant", "content": "paris"},
    ],
    # a system prompt, two turns, non-ASCII text
    [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": "capital of peru ?"},
        {"role": "assistant", "content": "lima"},
        {"role": "user", "content": "and of österreich ?"},
        {"role": "assistant", "content": "  vienna  "},
    ],
    # a prompt for generation
    [{"role": "user", "content": "name a city"}],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE trained on a few sentences, with the templates' special tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [
        "what is the capital of france paris lima vienna",
        "answer briefly and of österreich name a city",
    ]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    return tokenizer


def _transformers(tokenizer: Tokenizer, template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template, **SPECIAL_TOKENS)


def _ids(value: Any) -> list[int]:
    return list(value["input_ids"]) if isinstance(value, dict) or hasattr(value, "keys") else list(value)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_rendering_and_ids_equal_transformers(
    tokenizer: Tokenizer, name: str, conversation: int, generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    reference = _transformers(tokenizer, TEMPLATES[name])
    ours = ChatTemplate(TEMPLATES[name], special_tokens=SPECIAL_TOKENS)
    if name == "mistral" and messages[0]["role"] == "system":
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            ours.render(messages)
        return
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours.render(messages, add_generation_prompt=generation_prompt) == expected
    if not generation_prompt and messages[-1]["role"] == "assistant":
        ids, _ = encode_chat(ours, tokenizer, messages)
        assert ids == _ids(reference.apply_chat_template(messages, tokenize=True))


def test_extra_variables_reach_the_template(tokenizer: Tokenizer) -> None:
    messages = CONVERSATIONS[2]
    reference = _transformers(tokenizer, QWEN3_LIKE)
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    ours = ChatTemplate(QWEN3_LIKE, special_tokens=SPECIAL_TOKENS)
    assert ours.render(messages, add_generation_prompt=True, variables={"enable_thinking": False}) == expected
    assert "<think>" in expected


@pytest.mark.parametrize("name", sorted(set(TEMPLATES) - {"mistral"}))
def test_loss_falls_on_assistant_turns_only(tokenizer: Tokenizer, name: str) -> None:
    messages = CONVERSATIONS[1]
    template = ChatTemplate(TEMPLATES[name], special_tokens=SPECIAL_TOKENS)
    _, labels = encode_chat(template, tokenizer, messages)
    text = template.render(messages)
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    learned = "".join(text[a:b] for (a, b), label in zip(offsets, labels, strict=True) if label != -100)
    assert "lima" in learned and "vienna" in learned
    # nothing of the system prompt or the user turns, nor the assistant header, is learned
    assert "briefly" not in learned and "peru" not in learned and "österreich" not in learned
    assert "assistant" not in learned
    # the end of each turn is learned, so the model learns to stop
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3_like": "<|im_end|>"}[name]
    assert learned.count(end) == 2


def test_a_broken_template_names_the_problem() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", special_tokens={})
