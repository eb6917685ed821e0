"""d9d-rl: colocated reinforcement learning on d9d: losses, rollout engines, weight streaming."""

from d9d.rl._colocated_rollouts import (
    ColocatedRollouts,
    PromptSource,
    RewardFunction,
    RolloutRecord,
    rollout_seed,
)
from d9d.rl._embedded_engine import EmbeddedRolloutEngine
from d9d.rl._grpo_task import GRPOState, GRPOTask, RolloutBatch
from d9d.rl._kv_cache import KVCache, forward_with_cache
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
from d9d.rl._sampling import filter_logits, sample_next
from d9d.rl._weight_streaming import DEFAULT_BATCH_BYTES, StreamReport, stream_weights

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "Averaging",
    "ColocatedRollouts",
    "Completion",
    "EmbeddedRolloutEngine",
    "FinishReason",
    "GRPOLossConfig",
    "GRPOState",
    "GRPOTask",
    "KVCache",
    "PolicyLossResult",
    "PromptSource",
    "ReferenceConfig",
    "ReferenceModel",
    "RewardFunction",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutRecord",
    "SamplingParams",
    "StreamReport",
    "WeightReceiver",
    "filter_logits",
    "forward_with_cache",
    "group_advantages",
    "grpo_loss",
    "reinforce_loss",
    "rollout_seed",
    "sample_next",
    "stream_weights",
]
