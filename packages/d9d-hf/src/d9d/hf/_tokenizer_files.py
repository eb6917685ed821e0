"""The tokenizer files an export carries, so that ``transformers.AutoTokenizer`` loads it right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from d9d.hf._hub import TOKENIZER_FILES

_SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""config.json's special-token ids whose tokens the written ``tokenizer_config.json`` names."""


def tokenizer_files(directory: Path | None) -> dict[str, bytes]:
    """The tokenizer and generation files of a checkpoint directory, by file name.

    Every file of ``TOKENIZER_FILES`` present in ``directory`` is taken as is. A directory with a
    ``tokenizer.json`` but no ``tokenizer_config.json`` (one written by ``tokenizers`` alone) also
    gets a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``: without it,
    ``AutoTokenizer`` picks the tokenizer class of config.json's ``model_type`` (Qwen2's BPE for
    ``qwen3``), which silently misreads a tokenizer of another kind. The bos/eos/pad tokens of the
    directory's config.json, where it names them, become that file's special tokens.

    Args:
        directory: The checkpoint or tokenizer directory; None gives no files.
    """
    if directory is None:
        return {}
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    files = {name: (directory / name).read_bytes() for name in present}
    if "tokenizer.json" in files and "tokenizer_config.json" not in files:
        tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
        config = _read_json(directory / "config.json")
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", **_special_tokens(tokenizer, config)}
        files["tokenizer_config.json"] = (json.dumps(settings, indent=2, sort_keys=True) + "\n").encode()
    return files


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def _special_tokens(tokenizer: Tokenizer, config: dict[str, Any]) -> dict[str, str]:
    """``{"eos_token": "<eos>", ...}`` for each of config.json's ids that the tokenizer knows."""
    tokens: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_IDS:
        value = config.get(key)
        token = tokenizer.id_to_token(value) if isinstance(value, int) else None
        if token is not None:
            tokens[key.removesuffix("_id")] = token
    return tokens
