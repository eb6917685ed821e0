"""A checkpoint's tokenizer files: ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer

from d9d.hf.data._chat_template import ChatTemplate
from d9d.loop import DataError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerFilesError(DataError):
    """A tokenizer directory cannot be used (no chat template for chat data, say); the message names
    the file. A ``DataError``: the trainer and the examples report it as bad data, in one line."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = cast(dict[str, Any], value).get("content")
        return content if isinstance(content, str) else None
    return None


def _chat_template_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        for entry in cast(list[Any], value):
            if isinstance(entry, dict):
                named = cast(dict[str, Any], entry)
                if named.get("name") == "default" and isinstance(named.get("template"), str):
                    return cast(str, named["template"])
    return None


@dataclass(kw_only=True)
class TokenizerFiles:
    """What a tokenizer directory holds.

    Attributes:
        tokenizer: ``tokenizer.json``.
        special_tokens: ``bos_token``, ``eos_token``, ... of ``tokenizer_config.json`` as text.
        chat_template: The template text (``chat_template.jinja`` or ``tokenizer_config.json``),
            None when the checkpoint has none.
        directory: Where they were read from.
    """

    tokenizer: Tokenizer
    special_tokens: dict[str, str]
    chat_template: str | None
    directory: Path

    @staticmethod
    def load(directory: Path) -> TokenizerFiles:
        """Reads the files of ``directory``.

        Raises:
            TokenizerFilesError: If ``tokenizer.json`` is missing or a file is not valid.
        """
        tokenizer_file = directory / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises plain Exception on a missing or broken file
            raise TokenizerFilesError(f"cannot load {tokenizer_file}: {e}") from e
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.exists():
            try:
                loaded: Any = json.loads(config_file.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise TokenizerFilesError(f"cannot read {config_file}: {e}") from e
            if isinstance(loaded, dict):
                config = cast(dict[str, Any], loaded)
        special = {
            name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None
        }
        template_file = directory / "chat_template.jinja"
        template = (
            template_file.read_text()
            if template_file.exists()
            else _chat_template_text(config.get("chat_template"))
        )
        return TokenizerFiles(
            tokenizer=tokenizer, special_tokens=special, chat_template=template, directory=directory
        )

    def token_id(self, name: str) -> int | None:
        """The id of special token ``name`` (``eos_token``), None when it is not set."""
        text = self.special_tokens.get(name)
        return None if text is None else self.tokenizer.token_to_id(text)

    def template(self, override: str | None = None) -> ChatTemplate:
        """The chat template (``override`` instead of the checkpoint's, if given).

        Raises:
            TokenizerFilesError: If there is no template.
        """
        text = override if override is not None else self.chat_template
        if text is None:
            raise TokenizerFilesError(
                f"{self.directory} has no chat template (neither chat_template.jinja nor a chat_template "
                "in tokenizer_config.json): set dataset.format.template to a .jinja file"
            )
        return ChatTemplate(text, special_tokens=self.special_tokens)
