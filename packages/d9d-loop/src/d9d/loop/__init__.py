"""d9d-loop: the training job, from a validated config to a resumable run."""

from d9d.loop._auto_optimizer import AutoOptimizerProvider
from d9d.loop._batch_layout import BatchLayout
from d9d.loop._configurator import TrainingConfigurator
from d9d.loop._events import (
    CheckpointSaved,
    ConfigReady,
    EventBus,
    ForwardBackwardFinished,
    ForwardBackwardStarted,
    ModelReady,
    OptimizerStepFinished,
    OptimizerStepStarted,
    StepFinished,
    StepStarted,
    TrainingFinished,
)
from d9d.loop._inference import (
    Inference,
    InferenceConfig,
    InferenceConfigurator,
    InferenceFinishedContext,
    InferenceTask,
    ProcessOutputsContext,
)
from d9d.loop._lr_schedule import AutoLRSchedulerProvider, PiecewiseSchedule
from d9d.loop._model_provider import (
    FinalizeGradientsContext,
    InitializeModelStageContext,
    InitializeModelStageResult,
    LoadModelStageContext,
    LoadModelStageResult,
    ModelProvider,
    OptimizerSteppedContext,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    StagesReadyContext,
    StagesReadyResult,
)
from d9d.loop._optional_import import MissingExtraError
from d9d.loop._providers import (
    BatchSource,
    DataError,
    DataProvider,
    DataProviderContext,
    GradientScalingOptimizer,
    LRSchedulerProvider,
    LRSchedulerProviderContext,
    OptimizerProvider,
    OptimizerProviderContext,
)
from d9d.loop._sleep import SleepFinished, SleepStarted, TensorOffloader, WakeFinished, WakeStarted
from d9d.loop._stage_output_meta import StageOutputMeta
from d9d.loop._task import (
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    CreateMetricsContext,
    CreateMetricsResult,
    TaskFactory,
    TaskProvider,
    TaskProviderContext,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop._trainer import StepFailedError, Trainer
from d9d.loop.checkpoint._checkpointer import (
    Checkpointer,
    CheckpointLoadError,
    CheckpointLocation,
    CheckpointWriteError,
)
from d9d.loop.checkpoint._directory_checks import DirectoryCheckError
from d9d.loop.checkpoint._lock import CheckpointDirectoryLockedError
from d9d.loop.checkpoint._manifest import RunLayout
from d9d.loop.checkpoint._resume import NoUsableCheckpointError
from d9d.loop.checkpoint._resume_attempt import ResumeIncompatibleError
from d9d.loop.config._data import DataConfig
from d9d.loop.config._evaluation import BestEvaluationConfig, EvaluationConfig
from d9d.loop.config._lr import (
    ConstantLRSchedulerConfig,
    ConstantPhase,
    CosinePhase,
    ExponentialPhase,
    LinearPhase,
    LRPhaseConfig,
    LRSchedulerConfig,
    PiecewiseLRSchedulerConfig,
    WarmupConfig,
)
from d9d.loop.config._observability import GarbageCollectionConfig, ProfilingConfig
from d9d.loop.config._optimizer import (
    AdamConfig,
    AdamWConfig,
    HostOffloadConfig,
    OptimizerConfig,
    SGDConfig,
    StochasticAdamWConfig,
)
from d9d.loop.config._project import ConfigFileError, ProjectConfig, check_batch_layout
from d9d.loop.config._rank_agreement import RankDisagreementError
from d9d.loop.config._trackers import AimTrackerConfig, TensorBoardTrackerConfig, WandbTrackerConfig
from d9d.loop.config._trainer import (
    CheckpointConfig,
    GradientClippingConfig,
    InitializationConfig,
    JsonlTrackerConfig,
    LoggingConfig,
    NonFiniteConfig,
    NoTrackerConfig,
    ResumeConfig,
    RollbackOnNonFinite,
    SkipNonFinite,
    StopOnNonFinite,
    TimeoutConfig,
    TrackerConfig,
    TrainerConfig,
)
from d9d.loop.data._auto_data import AutoDataProvider, MapDataset, ShardedBatchSource
from d9d.loop.data._evaluation_data import EvaluationData
from d9d.loop.export._exporter import ExportError, ModelExporter
from d9d.loop.export._target import ExportTargetError, check_export_target, is_d9d_export
from d9d.loop.observability._flops import EstimateFlopsContext, EstimateFlopsResult
from d9d.loop.observability._tracker_group import TrackerGroup
from d9d.loop.observability._trackers import JsonlTracker, NoTracker, Tracker
from d9d.loop.observability._trackers_aim import AimTracker
from d9d.loop.observability._trackers_tensorboard import TensorBoardTracker
from d9d.loop.observability._trackers_wandb import WandbTracker
from d9d.loop.step._nonfinite_guard import NonFiniteError

__all__ = [
    "FinalizeGradientsContext",
    "TaskFactory",
    "ModelExporter",
    "ExportError",
    "ExportTargetError",
    "BatchLayout",
    "AdamConfig",
    "AdamWConfig",
    "AimTracker",
    "AimTrackerConfig",
    "AutoDataProvider",
    "AutoLRSchedulerProvider",
    "AutoOptimizerProvider",
    "BatchSource",
    "BuildForwardInputsContext",
    "BuildForwardInputsResult",
    "CheckpointConfig",
    "CheckpointDirectoryLockedError",
    "CheckpointLoadError",
    "CheckpointLocation",
    "CheckpointSaved",
    "CheckpointWriteError",
    "Checkpointer",
    "ComputeLossContext",
    "ComputeLossResult",
    "CreateMetricsContext",
    "CreateMetricsResult",
    "EvaluationConfig",
    "EvaluationData",
    "Inference",
    "InferenceConfig",
    "InferenceConfigurator",
    "InferenceFinishedContext",
    "InferenceTask",
    "ProcessOutputsContext",
    "BestEvaluationConfig",
    "UpdateMetricsContext",
    "ConfigFileError",
    "ConfigReady",
    "ConstantLRSchedulerConfig",
    "ConstantPhase",
    "CosinePhase",
    "DataConfig",
    "DataError",
    "DataProvider",
    "DataProviderContext",
    "DirectoryCheckError",
    "EstimateFlopsContext",
    "EstimateFlopsResult",
    "EventBus",
    "ExponentialPhase",
    "ForwardBackwardFinished",
    "ForwardBackwardStarted",
    "GarbageCollectionConfig",
    "GradientClippingConfig",
    "GradientScalingOptimizer",
    "InitializationConfig",
    "InitializeModelStageContext",
    "InitializeModelStageResult",
    "JsonlTracker",
    "JsonlTrackerConfig",
    "LRPhaseConfig",
    "LRSchedulerConfig",
    "LRSchedulerProvider",
    "LRSchedulerProviderContext",
    "LinearPhase",
    "LoadModelStageContext",
    "LoadModelStageResult",
    "LoggingConfig",
    "MapDataset",
    "MissingExtraError",
    "ModelProvider",
    "ModelReady",
    "OptimizerSteppedContext",
    "NoTracker",
    "NoTrackerConfig",
    "NoUsableCheckpointError",
    "NonFiniteConfig",
    "NonFiniteError",
    "OptimizerConfig",
    "OptimizerProvider",
    "OptimizerProviderContext",
    "OptimizerStepFinished",
    "OptimizerStepStarted",
    "ParallelizeModelStageContext",
    "PiecewiseLRSchedulerConfig",
    "PiecewiseSchedule",
    "PrepareExportModelStageContext",
    "PrepareExportModelStageResult",
    "ProfilingConfig",
    "ProjectConfig",
    "RankDisagreementError",
    "ResumeConfig",
    "ResumeIncompatibleError",
    "RollbackOnNonFinite",
    "RunLayout",
    "SGDConfig",
    "ShardedBatchSource",
    "SkipNonFinite",
    "SleepFinished",
    "SleepStarted",
    "StageOutputMeta",
    "StagesReadyContext",
    "StagesReadyResult",
    "StepFailedError",
    "StepFinished",
    "StepStarted",
    "StochasticAdamWConfig",
    "HostOffloadConfig",
    "StopOnNonFinite",
    "TaskProvider",
    "TaskProviderContext",
    "TensorBoardTracker",
    "TensorBoardTrackerConfig",
    "TensorOffloader",
    "TimeoutConfig",
    "Tracker",
    "TrackerGroup",
    "TrackerConfig",
    "TrainTask",
    "Trainer",
    "TrainerConfig",
    "TrainingConfigurator",
    "TrainingFinished",
    "WakeFinished",
    "WakeStarted",
    "WandbTracker",
    "WandbTrackerConfig",
    "WarmupConfig",
    "check_batch_layout",
    "check_export_target",
    "is_d9d_export",
]
