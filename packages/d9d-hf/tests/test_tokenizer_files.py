"""An export carries the tokenizer files transformers needs: AutoTokenizer loads it as the source's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import d9d.hf
from d9d.hf import (
    DecoderCausalLM,
    HFModelProvider,
    PretrainedModelConfig,
    TokenBatch,
    TokenSample,
    causal_lm_task,
)
from d9d.hf._tokenizer_files import tokenizer_files
from d9d.hf.qwen3 import Qwen3DenseConfig
from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ProjectConfig,
    TrainingConfigurator,
)

TEXTS = ["the cat sat on the mat", "a dog ran to the cat", "the mat is red"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def _word_tokenizer() -> Tokenizer:
    """A whitespace word-level tokenizer: a kind that Qwen's BPE tokenizer class misreads."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    return tokenizer


def _source(directory: Path, tokenizer_config: dict[str, object] | None = None) -> Path:
    """A tiny Qwen3 checkpoint saved by d9d.hf plus a ``tokenizer.json`` written by ``tokenizers``.

    ``tokenizer_config`` becomes its ``tokenizer_config.json`` (None: there is none).
    """
    tokenizer = _word_tokenizer()
    config = Qwen3DenseConfig.model_validate(
        {
            "model_type": "qwen3",
            "vocab_size": 32,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "pad_token_id": tokenizer.token_to_id("<pad>"),
            "eos_token_id": tokenizer.token_to_id("<eos>"),
        }
    )
    torch.manual_seed(0)
    model = DecoderCausalLM(config, attention_backend="eager")
    model.reset_parameters()
    d9d.hf.save_pretrained(model, directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


class _Rows:
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> TokenSample:
        ids = torch.arange(8) + index
        return TokenSample(input_ids=ids, labels=ids.clone())


def _export(source: Path, target: Path) -> None:
    config = ProjectConfig.model_validate(
        {
            "trainer": {
                "max_steps": 1,
                "global_batch_size": 2,
                "microbatch_size": 2,
                "device": "cpu",
                "logging": {"progress_bar": False},
            },
            "optimizer": {"name": "adamw", "lr": 0.01},
        }
    )
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=HFModelProvider(PretrainedModelConfig(source=str(source), attention_backend="eager")),
        task_provider=causal_lm_task,
        data_provider=AutoDataProvider(
            dataset_factory=lambda _: _Rows(), collator=TokenBatch.collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer:
        trainer.export(target)


TOKENIZER_CONFIGS: dict[str, dict[str, object] | None] = {
    # a tokenizer.json alone, as tokenizers writes it
    "none": None,
    # special tokens and a chat template but no class, as the finetune example's toy tokenizer had it
    "no_class": {"eos_token": "<eos>", "pad_token": "<pad>", "chat_template": "{{ messages }}"},
    # a model's own class that rebuilds a BPE pipeline: it would misread this word-level tokenizer
    "qwen2_class": {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<eos>", "pad_token": "<pad>"},
}


@pytest.mark.parametrize("tokenizer_config", sorted(TOKENIZER_CONFIGS))
def test_autotokenizer_loads_the_export_as_the_source_tokenizer(
    tmp_path: Path, tokenizer_config: str
) -> None:
    from transformers import AutoTokenizer

    source = _source(tmp_path / "source", TOKENIZER_CONFIGS[tokenizer_config])
    _export(source, tmp_path / "export")

    loaded = AutoTokenizer.from_pretrained(tmp_path / "export")
    original = Tokenizer.from_file(str(source / "tokenizer.json"))
    for text in [*TEXTS, "the red dog sat"]:
        assert loaded(text)["input_ids"] == original.encode(text).ids, text
    assert (loaded.eos_token, loaded.pad_token) == ("<eos>", "<pad>")
    assert loaded.decode(original.encode("the cat sat").ids) == "the cat sat"


def test_settings_other_than_the_class_are_kept(tmp_path: Path) -> None:
    _word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    settings = {"eos_token": "<eos>", "model_max_length": 8, "chat_template": "{{ messages }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))

    written = json.loads(tokenizer_files(tmp_path)["tokenizer_config.json"])

    assert written == {**settings, "tokenizer_class": "PreTrainedTokenizerFast"}


def test_transformers_generates_from_the_export_with_its_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _export(_source(tmp_path / "source"), tmp_path / "export")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")

    prompt = tokenizer("the cat sat on the", return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=3, do_sample=False)

    assert prompt["input_ids"].shape == (1, 5)  # five words, five tokens
    assert output.shape[1] > 5 and torch.equal(output[0, :5], prompt["input_ids"][0])
    assert isinstance(tokenizer.decode(output[0], skip_special_tokens=True), str)


def _bpe_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    return tokenizer


@pytest.mark.parametrize(
    ("tokenizer", "tokenizer_class"),
    [
        (_bpe_tokenizer, "Qwen2Tokenizer"),  # a checkpoint's own class on its BPE
        (_word_tokenizer, "PreTrainedTokenizerFast"),  # the class that reads tokenizer.json as it is
        (_word_tokenizer, "TokenizersBackend"),  # its name in transformers 5
    ],
)
def test_a_tokenizer_config_that_loads_tokenizer_json_is_copied_unchanged(
    tmp_path: Path, tokenizer: Callable[[], Tokenizer], tokenizer_class: str
) -> None:
    tokenizer().save(str(tmp_path / "tokenizer.json"))
    written = json.dumps({"tokenizer_class": tokenizer_class, "model_max_length": 8})
    (tmp_path / "tokenizer_config.json").write_text(written)
    (tmp_path / "generation_config.json").write_text("{}")

    files = tokenizer_files(tmp_path)

    assert files["tokenizer_config.json"].decode() == written
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}


@pytest.mark.parametrize("broken", ["{not json", "[1, 2]"])
def test_a_broken_tokenizer_config_is_refused_naming_it(tmp_path: Path, broken: str) -> None:
    _word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(broken)

    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        tokenizer_files(tmp_path)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, {}),  # no config.json: the class alone
        ({"eos_token_id": 1, "pad_token_id": 0}, {"eos_token": "<eos>", "pad_token": "<pad>"}),
        ({"eos_token_id": 999, "bos_token_id": None}, {}),  # ids the tokenizer does not know are left out
    ],
)
def test_a_bare_tokenizer_json_gets_a_config_naming_its_class(
    tmp_path: Path, config: dict[str, int | None], expected: dict[str, str]
) -> None:
    _word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    if config:
        (tmp_path / "config.json").write_text(json.dumps(config))

    written = json.loads(tokenizer_files(tmp_path)["tokenizer_config.json"])

    assert written == {"tokenizer_class": "PreTrainedTokenizerFast", **expected}


def test_no_directory_or_no_tokenizer_gives_no_files(tmp_path: Path) -> None:
    assert tokenizer_files(None) == {}
    assert tokenizer_files(tmp_path) == {}
