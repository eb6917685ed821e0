"""Records to rows by format: labels where the loss falls, errors naming the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from d9d.hf.data import (
    ChatFormatConfig,
    PromptCompletionFormatConfig,
    SFTDataConfig,
    SFTEncoder,
    TextFormatConfig,
    TokenizerFiles,
    TokenizerFilesError,
)
from d9d.hf.data._encoder import ChatEncoder
from d9d.loop.data import Record, RecordPosition, SampleError

ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] + ' <eos> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@pytest.fixture
def files(tmp_path: Path) -> TokenizerFiles:
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [
        "user",
        "assistant",
        "system",
        ":",
        "hi",
        "there",
        "capital",
        "of",
        "peru",
        "lima",
        "be",
        "brief",
    ]
    tokenizer.train_from_iterator(
        words, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"])
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "<eos>", "pad_token": "<pad>", "chat_template": ALTERNATING}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return TokenizerFiles.load(tmp_path)


def _record(fields: dict[str, object]) -> Record:
    return Record(fields=fields, where="data.jsonl:7", next=RecordPosition(index=7))


def _learned(files: TokenizerFiles, ids: list[int], labels: list[int]) -> list[str]:
    return [
        files.tokenizer.id_to_token(i) or "" for i, label in zip(ids, labels, strict=True) if label != -100
    ]


def test_chat_learns_the_assistant_turn_and_its_end(files: TokenizerFiles) -> None:
    encoder = SFTEncoder(files=files, format=ChatFormatConfig(), eos_id=2, pad_id=0)
    messages = [{"role": "user", "content": "capital of peru"}, {"role": "assistant", "content": "lima"}]
    row = encoder.encode(_record({"messages": messages}))
    assert _learned(files, row.input_ids, row.labels) == ["lima", "<eos>"]


def test_prompt_completion_and_text_put_the_loss_where_their_format_says(files: TokenizerFiles) -> None:
    pc = SFTEncoder(files=files, format=PromptCompletionFormatConfig(), eos_id=2, pad_id=0)
    row = pc.encode(_record({"prompt": "capital of peru", "completion": "lima"}))
    assert _learned(files, row.input_ids, row.labels) == ["lima", "<eos>"]
    text = SFTEncoder(files=files, format=TextFormatConfig(), eos_id=2, pad_id=0)
    row = text.encode(_record({"text": "hi there"}))
    assert _learned(files, row.input_ids, row.labels) == ["hi", "there", "<eos>"]


def test_the_chat_encoder_adds_a_missing_system_prompt_and_learns_from_the_given_turn(
    files: TokenizerFiles,
) -> None:
    chat = ChatEncoder(files, ChatFormatConfig(system_prompt="be brief"))
    user = {"role": "user", "content": "hi"}
    own_system = [{"role": "system", "content": "hi"}, user]
    assert chat.with_system_prompt([user]) == [{"role": "system", "content": "be brief"}, user]
    assert chat.with_system_prompt(own_system) == own_system
    turns = [
        user,
        {"role": "assistant", "content": "there"},
        {"role": "user", "content": "capital of peru"},
        {"role": "assistant", "content": "lima"},
    ]
    ids, labels = chat.encode(turns, where="here")
    assert _learned(files, ids, labels) == ["there", "<eos>", "lima", "<eos>"]
    ids, labels = chat.encode(turns, where="here", learn_from=2)
    assert _learned(files, ids, labels) == ["lima", "<eos>"]
    with pytest.raises(SampleError, match=r"^row 3: 'chosen': the chat template failed .*alternate"):
        chat.encode(chat.with_system_prompt([user]), where="row 3: 'chosen'")


@pytest.mark.parametrize(
    ("format", "fields", "message"),
    [
        # the template's raise_exception: a system turn first breaks the alternation
        (
            ChatFormatConfig(system_prompt="be brief"),
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]},
            r"data\.jsonl:7: the chat template failed to render: roles must alternate",
        ),
        (
            ChatFormatConfig(),
            {"conversation": []},
            r"data\.jsonl:7: field 'messages' must be a non-empty list",
        ),
        (ChatFormatConfig(), {"messages": [{"content": "no role"}]}, r"data\.jsonl:7: messages\[0\] is not"),
        (
            ChatFormatConfig(),
            {"messages": [{"role": "user", "content": "hi"}]},
            r"data\.jsonl:7: .*no token to learn",
        ),
        (PromptCompletionFormatConfig(), {"prompt": "hi"}, r"data\.jsonl:7: missing field 'completion'"),
        (TextFormatConfig(), {"text": 3}, r"data\.jsonl:7: field 'text' must be text, got int"),
    ],
)
def test_unusable_records_are_sample_errors_naming_file_and_line(
    files: TokenizerFiles,
    format: ChatFormatConfig | PromptCompletionFormatConfig | TextFormatConfig,
    fields: dict[str, object],
    message: str,
) -> None:
    encoder = SFTEncoder(files=files, format=format, eos_id=2, pad_id=0)
    with pytest.raises(SampleError, match=message):
        encoder.encode(_record(fields))


def test_the_dataset_section_takes_short_forms() -> None:
    config = SFTDataConfig.model_validate(
        {"source": "chats.jsonl", "format": "prompt_completion", "sequence_length": 64}
    )
    assert isinstance(config.format, PromptCompletionFormatConfig) and config.source.kind == "jsonl"
    assert isinstance(
        SFTDataConfig.model_validate({"source": "c.jsonl", "sequence_length": 8}).format, ChatFormatConfig
    )


def test_a_tokenizer_without_a_chat_template_names_the_config_key_that_supplies_one(
    files: TokenizerFiles,
) -> None:
    bare = TokenizerFiles(
        tokenizer=files.tokenizer,
        special_tokens=files.special_tokens,
        chat_template=None,
        directory=files.directory,
    )
    with pytest.raises(TokenizerFilesError, match=r"set dataset\.format\.template to a \.jinja file"):
        bare.template()


def test_a_missing_template_file_is_refused_when_the_config_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"template file .*missing\.jinja does not exist"):
        ChatFormatConfig(template=tmp_path / "missing.jinja")
    (tmp_path / "mine.jinja").write_text("{{ messages }}")
    assert ChatFormatConfig(template=tmp_path / "mine.jinja").template == tmp_path / "mine.jinja"
