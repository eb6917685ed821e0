"""Tokenizing and packing JSONL chat data on one CPU core: d9d's data pipeline vs a plain loop.

d9d: ``JsonlReader`` -> ``SFTEncoder`` (the chat template rendered with jinja2 as transformers
does, loss on assistant turns: the template is rendered once whole and twice per assistant turn
to find the turns) -> ``SequencePacker``. The plain loop: ``json.loads`` per line and
transformers' ``apply_chat_template(..., tokenize=True)`` (ids only, no loss mask, no packing).
Each variant runs in its own process pinned to one core with one thread, so its peak memory
(max RSS) is its own; rates are per second of the process's CPU time (on a shared machine the
wall time also counts other processes' turns on the core; it is printed beside). Then the
padding a batch carries: packed rows vs one sample per row padded to the batch's longest, with
and without length bucketing.

The data is synthetic (ChatML conversations of 1 to 3 turns over a 5,000-word vocabulary) and the
tokenizer a byte-level BPE trained on it here: nothing is downloaded.

Run:  uv run packages/d9d-hf/benchmarks/data_pipeline.py [--megabytes 20] [--sequence-length 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_data(path: Path, megabytes: float, seed: int) -> int:
    """Synthetic chats up to ``megabytes``; returns the number of lines."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(int(rng.lognormvariate(0, 0.8) * low) % high + 1))

    size, lines = 0, 0
    with path.open("w") as f:
        while size < megabytes * 1e6:
            messages = [{"role": "system", "content": text(10, 60)}]
            for _ in range(rng.randint(1, 3)):
                messages += [
                    {"role": "user", "content": text(40, 400)},
                    {"role": "assistant", "content": text(80, 900)},
                ]
            line = json.dumps({"messages": messages}) + "\n"
            f.write(line)
            size += len(line)
            lines += 1
    return lines


def write_tokenizer(directory: Path, data: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    sample = [
        json.loads(line)["messages"][1]["content"] for _, line in zip(range(2000), data.open(), strict=False)
    ]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8000, special_tokens=specials))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _pin() -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_d9d(data: Path, tokenizer_dir: Path, sequence_length: int) -> dict[str, Any]:
    from d9d.hf.data import ChatFormatConfig, SFTEncoder, TokenizerFiles
    from d9d.loop.data import DataReport, JsonlReader, RecordPosition, SequencePacker, fit_length

    files = TokenizerFiles.load(tokenizer_dir)
    encoder = SFTEncoder(files=files, format=ChatFormatConfig(), eos_id=1, pad_id=2)
    packer = SequencePacker(sequence_length=sequence_length, pad_id=2)
    report = DataReport()
    imported_mb = _max_rss_mb()
    tokens = rows = 0
    lengths = array("I")  # 4 bytes a sample: the lengths are kept for the padding shares
    start, cpu_start = time.perf_counter(), time.process_time()
    for record in JsonlReader(data).records(RecordPosition()):
        row = fit_length(
            encoder.encode(record), sequence_length=sequence_length, overlong="truncate", report=report
        )
        if row is None:
            continue
        tokens += len(row)
        lengths.append(len(row))
        rows += packer.add(row) is not None
    rows += packer.close() is not None
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "imported_mb": imported_mb,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens": tokens,
        "rows": rows,
        "truncated": report.truncated,
        "lengths": list(lengths),
    }  # type: ignore[dict-item]


def run_plain(data: Path, tokenizer_dir: Path, sequence_length: int) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), chat_template=CHATML
    )
    imported_mb = _max_rss_mb()
    tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    with data.open() as f:
        for line in f:
            ids = tokenizer.apply_chat_template(
                json.loads(line)["messages"], tokenize=True, return_dict=False
            )
            tokens += min(len(ids), sequence_length)
    return {
        "imported_mb": imported_mb,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "tokens": tokens,
    }


def padding_shares(
    lengths: list[int], *, sequence_length: int, rows: int, batch: int, window: int
) -> dict[str, float]:
    """Share of padding tokens: packed rows, padded batches, padded batches bucketed by length."""
    import torch

    from d9d.loop.data import bucketed_batches

    real = sum(lengths)

    def padded(window_batches: int) -> float:
        batches = bucketed_batches(
            lengths,
            global_batch_size=batch,
            window_batches=window_batches,
            generator=torch.Generator().manual_seed(0),
        )
        used = sum(lengths[i] for b in batches for i in b)
        total = sum(max(lengths[i] for i in b) * len(b) for b in batches)
        return 1 - used / total

    return {"packed": 1 - real / (rows * sequence_length), "padded": padded(1), "bucketed": padded(window)}


def child(variant: str, data: Path, tokenizer_dir: Path, sequence_length: int, out: Path) -> None:
    _pin()
    result = (run_d9d if variant == "d9d" else run_plain)(data, tokenizer_dir, sequence_length)
    result["max_rss_mb"] = _max_rss_mb()
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--megabytes", type=float, default=20.0)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32, help="rows per batch for the padding shares")
    parser.add_argument("--window", type=int, default=16, help="batches per bucketing window")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, data, tokenizer_dir, out = args.child
        child(variant, Path(data), Path(tokenizer_dir), args.sequence_length, Path(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "chats.jsonl"
        lines = write_data(data, args.megabytes, seed=0)
        write_tokenizer(root / "tok", data)
        size = data.stat().st_size / 1e6
        print(f"{size:.1f} MB, {lines} conversations, sequence_length {args.sequence_length}")
        results = {}
        for variant in ("d9d", "plain"):
            out = root / f"{variant}.json"
            command = [sys.executable, __file__, "--sequence-length", str(args.sequence_length)]
            subprocess.run([*command, "--child", variant, str(data), str(root / "tok"), str(out)], check=True)
            results[variant] = json.loads(out.read_text())
        for variant, label in (
            ("d9d", "d9d (render, loss mask, pack)"),
            ("plain", "plain apply_chat_template loop"),
        ):
            r = results[variant]
            rate = r["tokens"] / r["cpu_seconds"]
            megabytes = data.stat().st_size / 1e6 / r["cpu_seconds"]
            reading = r["max_rss_mb"] - r["imported_mb"]
            print(
                f"{label:32s} {rate:>9,.0f} tok/s {megabytes:6.2f} MB/s "
                f"(CPU time; wall {r['seconds']:.0f} s)  "
                f"peak RSS {r['max_rss_mb']:5.0f} MB "
                f"({r['imported_mb']:.0f} MB after imports, +{reading:.0f} MB reading)"
            )
        d9d = results["d9d"]
        shares = padding_shares(
            d9d["lengths"],
            sequence_length=args.sequence_length,
            rows=d9d["rows"],
            batch=args.batch,
            window=args.window,
        )
        print(
            f"padding share: packed {shares['packed']:.1%}, one sample per row padded to the batch's longest "
            f"{shares['padded']:.1%}, with length bucketing (window {args.window}) {shares['bucketed']:.1%}"
        )


if __name__ == "__main__":
    main()
