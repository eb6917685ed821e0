"""The fine-tuning example's generated toy set and tiny model under ``torchrun``: every rank finds
them missing and writes them, so another rank may finish first (it crashed ``torchrun
--nproc-per-node 4 train.py config.yaml`` on a fresh work_dir with ``OSError: Directory not empty``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune-qwen3"


@pytest.fixture
def toy_setup(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return importlib.import_module("toy_setup")


def test_a_tiny_checkpoint_another_rank_finished_first_is_kept(toy_setup: ModuleType, tmp_path: Path) -> None:
    pairs = tmp_path / "toy_pairs.jsonl"
    toy_setup.write_toy_pairs(pairs, seed=0)
    texts = toy_setup.record_texts(pairs)
    target = tmp_path / "tiny-qwen3"
    toy_setup.write_tiny_checkpoint(target, texts=texts, seed=0)  # the rank that finished first
    first = {f.name: f.read_bytes() for f in target.iterdir()}
    # Another rank saw no checkpoint when it started and now finishes its own, identical one.
    another_ranks_staging = tmp_path / ".tiny-qwen3.partial"
    another_ranks_staging.mkdir()
    (another_ranks_staging / "model.safetensors").write_bytes(b"half written")
    toy_setup.write_tiny_checkpoint(target, texts=texts, seed=0)
    assert {f.name: f.read_bytes() for f in target.iterdir()} == first
    assert (another_ranks_staging / "model.safetensors").read_bytes() == b"half written"  # not ours
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tiny-qwen3.partial",
        "tiny-qwen3",
        "toy_pairs.jsonl",
    ]


def test_the_toy_set_is_replaced_whole(toy_setup: ModuleType, tmp_path: Path) -> None:
    # A rank reading the toy set while another writes it reads a whole file: each rank writes its
    # own and moves it into place, so the file is never truncated in place.
    pairs = tmp_path / "toy_pairs.jsonl"
    toy_setup.write_toy_pairs(pairs, seed=0)
    first = pairs.read_text()
    with pairs.open() as reading:
        toy_setup.write_toy_pairs(pairs, seed=1)  # another order, to tell the two apart
        assert reading.read() == first  # the file this rank opened stays whole
    assert pairs.read_text() != first and len(pairs.read_text().splitlines()) == 80
    assert [p.name for p in tmp_path.iterdir()] == ["toy_pairs.jsonl"]
