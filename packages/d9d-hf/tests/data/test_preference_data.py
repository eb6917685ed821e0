"""Preference rows to token pairs: loss on the answer only; a row missing a side refused by index and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from d9d.hf.data import (
    PreferenceChatFormatConfig,
    PreferenceDataConfig,
    PreferenceEncoder,
    PreferenceTextFormatConfig,
    TokenizerFiles,
    load_preference_pairs,
)
from d9d.loop.data import Record, RecordPosition, SampleError, TokenRow

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' <eos> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
WORDS = ["user", "assistant", "system", ":", "hi", "there", "capital", "of", "peru", "lima", "cusco"]


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        WORDS, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"])
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "<eos>", "pad_token": "<pad>", "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def _tokens(files: TokenizerFiles, row: TokenRow) -> tuple[str, list[str]]:
    def word(i: int) -> str:
        return files.tokenizer.id_to_token(i) or ""

    text = " ".join(word(i) for i in row.input_ids)
    return text, [word(i) for i, label in zip(row.input_ids, row.labels, strict=True) if label != -100]


def _record(fields: dict[str, object]) -> Record:
    return Record(fields=fields, where="pairs.jsonl:4", next=RecordPosition(index=4))


def test_chat_learns_each_answer_after_the_prompt_and_not_the_prompts_own_assistant_turn(
    directory: Path,
) -> None:
    files = TokenizerFiles.load(directory)
    encoder = PreferenceEncoder(files=files, format=PreferenceChatFormatConfig(), eos_id=2, pad_id=0)
    prompt = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hi there"},  # history: not learned
        {"role": "user", "content": "capital of peru"},
    ]
    pair = encoder.encode(
        _record(
            {"prompt": prompt, "chosen": [{"role": "assistant", "content": "lima"}], "rejected": "cusco"}
        ),
        3,
    )
    text, learned = _tokens(files, pair.chosen)
    assert (
        text
        == "user : hi <eos> assistant : hi there <eos> user : capital of peru <eos> assistant : lima <eos>"
    )
    assert learned == ["lima", "<eos>"]
    assert _tokens(files, pair.rejected)[1] == ["cusco", "<eos>"]  # a string answer is one assistant turn
    assert pair.index == 3


def test_text_puts_the_separator_and_eos_around_each_answer(directory: Path) -> None:
    files = TokenizerFiles.load(directory)
    encoder = PreferenceEncoder(files=files, format=PreferenceTextFormatConfig(), eos_id=2, pad_id=0)
    pair = encoder.encode(_record({"prompt": "capital of peru", "chosen": "lima", "rejected": "cusco"}), 0)
    assert _tokens(files, pair.chosen) == ("capital of peru lima <eos>", ["lima", "<eos>"])
    assert _tokens(files, pair.rejected) == ("capital of peru cusco <eos>", ["cusco", "<eos>"])


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_row_without_chosen_or_rejected_is_refused_naming_its_index_and_the_key(
    directory: Path, tmp_path: Path
) -> None:
    good = {"prompt": "hi", "chosen": "lima", "rejected": "cusco"}
    source = _write(tmp_path / "pairs.jsonl", [good, good, {"prompt": "hi", "chosen": "lima"}, good])
    config = PreferenceDataConfig.model_validate(
        {"source": str(source), "format": "text", "sequence_length": 16}
    )
    with pytest.raises(SampleError, match=r"row 2 \(.*pairs.jsonl:3\): missing key 'rejected'"):
        load_preference_pairs(config, tokenizer_directory=directory)
    source = _write(tmp_path / "pairs.jsonl", [{"prompt": "hi", "chosen": None, "rejected": "cusco"}])
    with pytest.raises(SampleError, match=r"row 0 .*missing key 'chosen'"):
        load_preference_pairs(config, tokenizer_directory=directory)


@pytest.mark.parametrize(
    ("overlong", "kept", "truncated", "dropped"),
    [
        ("truncate", 2, 1, 0),  # the long pair's sides cut to 4 tokens, each still ending in answer tokens
        ("drop", 1, 0, 1),  # the long pair left out
    ],
)
def test_overlong_pairs_are_cut_or_dropped_and_counted(
    directory: Path, tmp_path: Path, overlong: str, kept: int, truncated: int, dropped: int
) -> None:
    rows = [
        {"prompt": "hi", "chosen": "lima", "rejected": "cusco"},  # 3 tokens a side
        {"prompt": "hi", "chosen": "lima lima lima lima", "rejected": "cusco"},  # chosen: 6 tokens
    ]
    source = _write(tmp_path / "pairs.jsonl", rows)
    config = PreferenceDataConfig.model_validate(
        {"source": str(source), "format": {"kind": "text"}, "sequence_length": 4, "overlong": overlong}
    )
    data = load_preference_pairs(config, tokenizer_directory=directory)
    assert len(data.pairs) == kept
    assert (data.report.samples, data.report.truncated, data.report.dropped) == (kept, truncated, dropped)
    assert all(len(side) <= 4 for pair in data.pairs for side in (pair.chosen, pair.rejected))
    assert data.pad_id == 0


def test_the_config_refuses_unknown_keys_and_formats() -> None:
    with pytest.raises(ValueError, match="chosen_column"):
        PreferenceDataConfig.model_validate(
            {"source": "x.jsonl", "sequence_length": 8, "format": {"kind": "chat", "chosen_column": "a"}}
        )
    with pytest.raises(ValueError, match="prompt_completion"):
        PreferenceDataConfig.model_validate(
            {"source": "x.jsonl", "sequence_length": 8, "format": "prompt_completion"}
        )
