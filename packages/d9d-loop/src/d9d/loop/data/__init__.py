"""Token data for training: readers (JSONL, Parquet, ``datasets``), packing, padding, batch sources."""

from d9d.loop.data._bucketed_source import BucketedBatchSource, bucketed_batches
from d9d.loop.data._config import TokenDataConfig
from d9d.loop.data._hf_datasets import HFDatasetReader
from d9d.loop.data._jsonl import JsonlReader
from d9d.loop.data._packing import SequencePacker, fit_length, pack_rows
from d9d.loop.data._parquet import ParquetReader
from d9d.loop.data._provider import SampleEncoder, SampleError, TokenDataProvider
from d9d.loop.data._records import DataFileError, Record, RecordPosition, RecordReader
from d9d.loop.data._report import DataReport, OverlongPolicy
from d9d.loop.data._rows import IGNORE_INDEX, PaddingCollator, RowBatch, TokenRow, stack_rows
from d9d.loop.data._source_config import (
    DataSourceConfig,
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    ParquetSourceConfig,
    open_source,
)
from d9d.loop.data._streaming_source import StreamingBatchSource

__all__ = [
    "IGNORE_INDEX",
    "BucketedBatchSource",
    "DataFileError",
    "DataReport",
    "DataSourceConfig",
    "HFDatasetReader",
    "HFDatasetSourceConfig",
    "JsonlReader",
    "JsonlSourceConfig",
    "OverlongPolicy",
    "PaddingCollator",
    "ParquetReader",
    "ParquetSourceConfig",
    "Record",
    "RecordPosition",
    "RecordReader",
    "RowBatch",
    "SampleEncoder",
    "SampleError",
    "SequencePacker",
    "StreamingBatchSource",
    "TokenDataConfig",
    "TokenDataProvider",
    "TokenRow",
    "bucketed_batches",
    "fit_length",
    "open_source",
    "pack_rows",
    "stack_rows",
]
