"""Resolving a Hugging Face Hub repo id or a local directory to a local snapshot."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
"""The tokenizer and generation files of a checkpoint (fetched, and copied into every export)."""

SNAPSHOT_PATTERNS = ("config.json", "*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES)
"""What a snapshot fetches: the config, the weights with their index, and the tokenizer files."""


def resolve_snapshot(source: str | os.PathLike[str], *, revision: str | None = None) -> Path:
    """Returns a local directory holding ``source``'s config, weights and tokenizer.

    An existing local directory is returned as is. Anything else is taken as a Hub repo id and
    fetched with ``huggingface_hub.snapshot_download`` (only ``SNAPSHOT_PATTERNS``, into the
    Hugging Face cache, with its progress bars); ``HF_HUB_OFFLINE=1`` makes that a cache lookup.

    Args:
        source: A local directory or a Hub repo id such as ``"Qwen/Qwen3-0.6B"``.
        revision: Branch, tag or commit of a Hub repo (ignored for a local directory).

    Raises:
        FileNotFoundError: If ``source`` is a path that does not exist (starts with ``.`` or
            ``/``, or names an existing parent's missing child).
    """
    path = Path(source)
    if path.is_dir():
        return path
    text = os.fspath(source)
    if text.startswith((".", "/", "~")) or path.exists() or text.count("/") > 1:
        raise FileNotFoundError(f"{text}: no such directory (and not a Hub repo id 'owner/name')")
    snapshot = huggingface_hub.snapshot_download(
        repo_id=text, revision=revision, allow_patterns=list(SNAPSHOT_PATTERNS)
    )
    return Path(snapshot)
