"""The ``data`` section of a token-data job: where samples come from and how they become rows."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.loop.data._report import OverlongPolicy
from d9d.loop.data._source_config import DataSourceConfig


class TokenDataConfig(BaseModel):
    """How samples are read and turned into rows of tokens (see ``TokenDataProvider``).

    The order (``shuffle``, ``seed``) and loader workers stay in the job's ``data`` section
    (``DataConfig``); this is the ``dataset`` section beside it.

    Attributes:
        source: A ``.jsonl`` / ``.parquet`` path, or ``{kind: jsonl|parquet|hf_datasets, ...}``.
        sequence_length: Tokens per row; the longest sample kept.
        packing: Pack samples into rows of exactly ``sequence_length`` tokens, each sample its
            own document (attention and positions restart). False: one sample per row, padded
            to the longest row of its batch.
        overlong: A sample longer than ``sequence_length`` is cut (``truncate``) or left out
            (``drop``); either is counted and reported.
        bad_samples: A sample that cannot be used (a missing field, a template that fails to
            render) stops the run naming file and line (``error``), or is counted and left out
            (``skip``).
        streaming: Read the source as training goes (for data larger than memory; resumes at the
            exact sample, in file order whatever ``data.shuffle`` says, needs
            ``trainer.max_steps``). False: read it all at start (``data.shuffle`` per epoch,
            held-out split, length bucketing).
        bucket_window: Without packing: global batches whose samples are sorted by length
            together, so a batch pads little (1: no bucketing).
        pad_to_multiple_of: Without packing: round each batch's padded length up to this.
        eval_fraction: Share of the samples held out for evaluation (not with ``streaming``),
            picked with ``data.seed``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: DataSourceConfig
    sequence_length: int = Field(ge=2)
    packing: bool = True
    overlong: OverlongPolicy = "truncate"
    bad_samples: Literal["error", "skip"] = "error"
    streaming: bool = False
    bucket_window: int = Field(default=16, ge=1)
    pad_to_multiple_of: int = Field(default=8, ge=1)
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _streaming_limits(self) -> Self:
        if self.streaming and self.eval_fraction > 0:
            raise ValueError("eval_fraction needs the whole data set in memory: not with streaming: true")
        return self
