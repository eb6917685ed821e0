"""Sources: a local directory is used as is; a missing path is never sent to the Hub."""

from __future__ import annotations

import pytest

from d9d.hf import resolve_snapshot


def test_local_directory_is_returned(tmp_path) -> None:
    assert resolve_snapshot(tmp_path) == tmp_path


@pytest.mark.parametrize("source", ["./nope", "/nope/model", "a/b/c"])
def test_missing_path_raises(source) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_snapshot(source)


def test_repo_id_goes_to_snapshot_download_offline(monkeypatch) -> None:
    import huggingface_hub

    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        return "/cache/snapshot"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert str(resolve_snapshot("Qwen/Qwen3-0.6B", revision="main")) == "/cache/snapshot"
    assert calls[0]["repo_id"] == "Qwen/Qwen3-0.6B" and calls[0]["revision"] == "main"
    assert "*.safetensors" in calls[0]["allow_patterns"] and "tokenizer.json" in calls[0]["allow_patterns"]
