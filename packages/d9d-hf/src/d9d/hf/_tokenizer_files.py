"""The tokenizer files an export carries, so that ``transformers.AutoTokenizer`` loads it right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer

from d9d.hf._hub import TOKENIZER_FILES

_SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""config.json's special-token ids whose tokens the written ``tokenizer_config.json`` names."""

_AS_IS_CLASS = "PreTrainedTokenizerFast"
"""The transformers class that loads ``tokenizer.json`` as it is (``TokenizersBackend`` in transformers 5)."""

_AS_IS_CLASSES = (_AS_IS_CLASS, "TokenizersBackend")


def tokenizer_files(directory: Path | None) -> dict[str, bytes]:
    """The tokenizer and generation files of a checkpoint directory, by file name.

    Every file of ``TOKENIZER_FILES`` present in ``directory`` is taken as is, except a
    ``tokenizer_config.json`` that would make ``AutoTokenizer`` load another tokenizer than
    ``tokenizer.json`` (the one d9d trains with):

    - none at all (a directory written by ``tokenizers`` alone): one is written naming
      ``PreTrainedTokenizerFast``, with the bos/eos/pad tokens of the directory's config.json
      where it names them;
    - one without ``tokenizer_class``: ``PreTrainedTokenizerFast`` is added, the rest kept;
    - one naming a model's own class (``Qwen2Tokenizer``) for a ``tokenizer.json`` that is not a
      BPE: that class is replaced by ``PreTrainedTokenizerFast``.

    Without a ``tokenizer_class``, ``AutoTokenizer`` picks the class of config.json's
    ``model_type`` (``Qwen2Tokenizer`` for ``qwen3``), and a model's own class rebuilds its BPE
    pipeline from ``tokenizer.json``'s vocabulary: a word-level tokenizer, say, then encodes a
    sentence as one unknown token. ``PreTrainedTokenizerFast`` reads ``tokenizer.json`` as it is.
    A model's own class on a BPE ``tokenizer.json`` is kept: it is what the checkpoint ships.

    Args:
        directory: The checkpoint or tokenizer directory; None gives no files.

    Raises:
        ValueError: If ``tokenizer.json`` or ``tokenizer_config.json`` is not valid JSON.
    """
    if directory is None:
        return {}
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    files = {name: (directory / name).read_bytes() for name in present}
    if "tokenizer.json" not in files:
        return files
    tokenizer_json = _json_object(directory / "tokenizer.json", files["tokenizer.json"])
    if "tokenizer_config.json" not in files:
        tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
        config = _read_json(directory / "config.json")
        settings = {"tokenizer_class": _AS_IS_CLASS, **_special_tokens(tokenizer, config)}
        files["tokenizer_config.json"] = _dumps(settings)
        return files
    settings = _json_object(directory / "tokenizer_config.json", files["tokenizer_config.json"])
    named = settings.get("tokenizer_class")
    model: Any = tokenizer_json.get("model")
    kind = cast(dict[str, Any], model).get("type") if isinstance(model, dict) else None
    if named is None or (named not in _AS_IS_CLASSES and kind != "BPE"):
        files["tokenizer_config.json"] = _dumps({**settings, "tokenizer_class": _AS_IS_CLASS})
    return files


def _json_object(path: Path, data: bytes) -> dict[str, Any]:
    try:
        loaded: Any = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(loaded).__name__}")
    return cast(dict[str, Any], loaded)


def _dumps(settings: dict[str, Any]) -> bytes:
    return (json.dumps(settings, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


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
