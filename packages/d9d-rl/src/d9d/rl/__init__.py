"""d9d-rl: colocated reinforcement learning on d9d: losses, rollout engines, weight streaming."""

from d9d.rl._block_pool import BlockPool
from d9d.rl._colocated_rollouts import (
    ColocatedRollouts,
    PromptSource,
    RewardFunction,
    RolloutRecord,
    rollout_seed,
)
from d9d.rl._dpo_batch import DPOBatch, ReferenceScore, collate_pairs, preference_rows
from d9d.rl._dpo_data import DPODataProvider, score_pairs
from d9d.rl._dpo_loss import DPOLossConfig, DPOLossResult, PreferenceLoss, dpo_loss, sequence_log_probs
from d9d.rl._dpo_task import METRIC_NAMES as DPO_METRIC_NAMES
from d9d.rl._dpo_task import DPOState, DPOTask
from d9d.rl._embedded_engine import EmbeddedRolloutEngine, EngineStats
from d9d.rl._engine_config import CompileBackend, EmbeddedEngineConfig
from d9d.rl._grpo_task import GRPOState, GRPOTask, RolloutBatch
from d9d.rl._kv_cache import PagedBatch, PagedKVCache, forward_paged
from d9d.rl._losses import (
    Averaging,
    GRPOLossConfig,
    PolicyLossResult,
    group_advantages,
    grpo_loss,
    reinforce_loss,
)
from d9d.rl._reference_model import ReferenceConfig, ReferenceModel
from d9d.rl._rollout_engine import Completion, FinishReason, RolloutEngine, SamplingParams, WeightReceiver
from d9d.rl._sampling import filter_logits, keyed_gumbel_noise, sample_keyed, sample_next
from d9d.rl._weight_streaming import DEFAULT_BATCH_BYTES, StreamReport, stream_weights

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DPO_METRIC_NAMES",
    "Averaging",
    "BlockPool",
    "ColocatedRollouts",
    "CompileBackend",
    "Completion",
    "DPOBatch",
    "DPODataProvider",
    "DPOLossConfig",
    "DPOLossResult",
    "DPOState",
    "DPOTask",
    "EmbeddedEngineConfig",
    "EmbeddedRolloutEngine",
    "EngineStats",
    "FinishReason",
    "GRPOLossConfig",
    "GRPOState",
    "GRPOTask",
    "PagedBatch",
    "PagedKVCache",
    "PolicyLossResult",
    "PreferenceLoss",
    "PromptSource",
    "ReferenceConfig",
    "ReferenceModel",
    "ReferenceScore",
    "RewardFunction",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutRecord",
    "SamplingParams",
    "StreamReport",
    "WeightReceiver",
    "collate_pairs",
    "dpo_loss",
    "filter_logits",
    "forward_paged",
    "group_advantages",
    "grpo_loss",
    "keyed_gumbel_noise",
    "preference_rows",
    "reinforce_loss",
    "rollout_seed",
    "sample_keyed",
    "sample_next",
    "score_pairs",
    "sequence_log_probs",
    "stream_weights",
]
