"""The fine-tuning data provider: ``TokenDataProvider`` with d9d-hf's encoder and ``TokenBatch``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from d9d.hf import TokenBatch
from d9d.hf.data._config import SFTDataConfig
from d9d.hf.data._encoder import SFTEncoder
from d9d.hf.data._tokenizer_files import TokenizerFiles, TokenizerFilesError
from d9d.loop import DataConfig
from d9d.loop.data import RowBatch, TokenDataProvider
from d9d.mesh import DistributedContext


def token_batch(rows: RowBatch) -> TokenBatch:
    """A ``RowBatch`` as the causal-LM task's batch (padding has label -100 and no loss)."""
    return TokenBatch(input_ids=rows.input_ids, labels=rows.labels, document_ids=rows.document_ids)


def sft_data_provider(
    config: SFTDataConfig,
    *,
    order: DataConfig,
    tokenizer_directory: Callable[[DistributedContext], Path],
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> TokenDataProvider[TokenBatch]:
    """A data provider for ``causal_lm_task`` from the ``dataset`` section.

    Args:
        config: The ``dataset`` section.
        order: The job's ``data`` section (order, seed, loader workers).
        tokenizer_directory: Where ``tokenizer.json`` (and the chat template) are, resolved on
            each rank when the data is built (after the model, e.g. a downloaded snapshot).
        eos_id: The end-of-sequence id (default: ``eos_token`` of ``tokenizer_config.json``).
        pad_id: The padding id (default: ``pad_token``, else the end-of-sequence id).
    """

    def encoder(dist_context: DistributedContext) -> SFTEncoder:
        files = TokenizerFiles.load(tokenizer_directory(dist_context))
        eos = eos_id if eos_id is not None else files.token_id("eos_token")
        if eos is None:
            raise TokenizerFilesError(
                f"{files.directory}/tokenizer_config.json names no eos_token: "
                "pass eos_id (the model's eos_token_id)"
            )
        pad = pad_id if pad_id is not None else files.token_id("pad_token")
        return SFTEncoder(files=files, format=config.format, eos_id=eos, pad_id=eos if pad is None else pad)

    return TokenDataProvider(config=config, order=order, encoder_factory=encoder, convert=token_batch)
