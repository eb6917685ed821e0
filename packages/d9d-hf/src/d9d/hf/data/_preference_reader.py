"""Every preference row of a source, read and checked before training."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from d9d.hf.data._preference_config import PreferenceDataConfig
from d9d.hf.data._preference_encoder import PreferenceEncoder, PreferencePair
from d9d.hf.data._tokenizer_files import TokenizerFiles, TokenizerFilesError
from d9d.loop.data import DataFileError, DataReport, RecordPosition, TokenRow, fit_length, open_source


@dataclass(kw_only=True)
class PreferenceData:
    """The pairs of a source and what happened to its rows.

    Attributes:
        pairs: The usable pairs, in source order.
        report: Pairs used, truncated and dropped (``samples`` counts pairs).
        source: The source as named in messages.
        pad_id: The padding token id of the encoder that made them.
    """

    pairs: list[PreferencePair]
    report: DataReport = field(default_factory=DataReport)
    source: str = ""
    pad_id: int = 0


def _fit(pair: PreferencePair, config: PreferenceDataConfig, report: DataReport) -> PreferencePair | None:
    """Both sides cut (or the pair left out) as ``config.overlong`` says; counted per pair."""
    length = config.sequence_length
    if len(pair.chosen) <= length and len(pair.rejected) <= length:
        report.samples += 1
        return pair
    scratch = DataReport()
    sides: list[TokenRow | None] = [
        fit_length(side, sequence_length=length, overlong=config.overlong, report=scratch)
        for side in (pair.chosen, pair.rejected)
    ]
    chosen, rejected = sides
    longest = max(len(pair.chosen), len(pair.rejected))
    if chosen is None or rejected is None:
        report.dropped += 1
        report.note(f"{pair.chosen.where}: a side of {longest} tokens is over {length}, dropped")
        return None
    report.truncated += 1
    report.samples += 1
    report.note(f"{pair.chosen.where}: a side of {longest} tokens truncated to {length}")
    return PreferencePair(chosen=chosen, rejected=rejected, index=pair.index)


def read_preference_pairs(config: PreferenceDataConfig, encoder: PreferenceEncoder) -> PreferenceData:
    """Reads, encodes and fits every row of ``config.source``.

    Raises:
        SampleError: At the first row without its prompt, chosen or rejected field (naming the
            row's index and the key), or that cannot be encoded.
        DataFileError: If no pair is left.
    """
    reader = open_source(config.source)
    data = PreferenceData(pairs=[], source=reader.name, pad_id=encoder.pad_id)
    for index, record in enumerate(reader.records(RecordPosition())):
        fitted = _fit(encoder.encode(record, index), config, data.report)
        if fitted is not None:
            data.pairs.append(fitted)
    if not data.pairs:
        raise DataFileError(f"{reader.name}: no usable preference pairs ({data.report.summary(reader.name)})")
    return data


def load_preference_pairs(
    config: PreferenceDataConfig,
    *,
    tokenizer_directory: Path,
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> PreferenceData:
    """``read_preference_pairs`` with the encoder of a tokenizer directory.

    Args:
        config: The ``dataset`` section.
        tokenizer_directory: Where ``tokenizer.json`` (and the chat template) are.
        eos_id: The end-of-sequence id (default: ``eos_token`` of ``tokenizer_config.json``).
        pad_id: The padding id (default: ``pad_token``, else the end-of-sequence id).

    Raises:
        TokenizerFilesError: If the directory names no end-of-sequence token and none is given.
    """
    files = TokenizerFiles.load(tokenizer_directory)
    eos = eos_id if eos_id is not None else files.token_id("eos_token")
    if eos is None:
        raise TokenizerFilesError(
            f"{files.directory}/tokenizer_config.json names no eos_token: "
            "pass eos_id (the model's eos_token_id)"
        )
    pad = pad_id if pad_id is not None else files.token_id("pad_token")
    pad = eos if pad is None else pad
    encoder = PreferenceEncoder(files=files, format=config.format, eos_id=eos, pad_id=pad)
    return read_preference_pairs(config, encoder)
