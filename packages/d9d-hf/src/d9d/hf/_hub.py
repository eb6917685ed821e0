"""Resolving a Hugging Face Hub repo id or a local directory to a local snapshot."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

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
            ``/``, or names an existing parent's missing child), or a repo id the Hub cannot
            provide (offline without a cached copy, unknown, gated, unknown revision): one
            message naming the repo id and what to do instead.
    """
    path = Path(source)
    if path.is_dir():
        return path
    text = os.fspath(source)
    if text.startswith((".", "/", "~")) or path.exists() or text.count("/") > 1:
        raise FileNotFoundError(f"{text}: no such directory (and not a Hub repo id 'owner/name')")
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id=text, revision=revision, allow_patterns=list(SNAPSHOT_PATTERNS)
        )
    except (LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, HfHubHTTPError) as error:
        # The Hub's own error chains the network failures under it (dozens of lines that never
        # name the repo): one message says what was asked for and what to do instead.
        raise FileNotFoundError(_unavailable(text, revision, error)) from None
    return Path(snapshot)


def _unavailable(repo_id: str, revision: str | None, error: Exception) -> str:
    asked = repo_id if revision is None else f"{repo_id} (revision {revision!r})"
    reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (
        f"{asked}: not a local directory, and the Hugging Face Hub could not provide it "
        f"({type(error).__name__}: {reason}). Pass the path of a local checkpoint directory, or "
        f"download it once where the Hub is reachable (`hf download {repo_id}`): with "
        "HF_HUB_OFFLINE=1 the cached copy is then used without network"
    )
