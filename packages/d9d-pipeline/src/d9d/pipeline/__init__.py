"""d9d pipeline parallelism: schedules as programs, executors and a simulator."""

from d9d.pipeline._actions import (
    Action,
    ActionKind,
    backward,
    backward_input,
    backward_weight,
    forward,
)
from d9d.pipeline._communication import insert_communication, make_program
from d9d.pipeline._config import (
    DualPipeVScheduleConfig,
    ForwardOnlyScheduleConfig,
    GPipeScheduleConfig,
    Interleaved1F1BScheduleConfig,
    InterleavedZeroBubbleScheduleConfig,
    LoopedBFSScheduleConfig,
    OneFOneBScheduleConfig,
    PipelineScheduleBuilder,
    PipelineScheduleConfig,
    ZBVScheduleConfig,
    build_program,
    stages_for_rank,
    stages_per_rank,
)
from d9d.pipeline._drawing import draw_timeline_png, draw_timeline_text
from d9d.pipeline._executor import PipelineExecutor
from d9d.pipeline._local_executor import LocalPipelineExecutor
from d9d.pipeline._optim import StagesLRScheduler, StagesOptimizer
from d9d.pipeline._overlap import OverlapPoint, OverlapPoints
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._schedules._dualpipev import build_dualpipev_program
from d9d.pipeline._schedules._interleaved import build_interleaved_1f1b_program, build_looped_bfs_program
from d9d.pipeline._schedules._simple import (
    build_1f1b_program,
    build_forward_only_program,
    build_gpipe_program,
)
from d9d.pipeline._schedules._zero_bubble import build_interleaved_zero_bubble_program, build_zbv_program
from d9d.pipeline._shapes import PipelineOutputMeta, PipelineShapeError
from d9d.pipeline._simulator import ActionCosts, SimulationResult, simulate_program
from d9d.pipeline._stage_info import PipelineStageInfo, assign_layers, layers_of_stage
from d9d.pipeline._stage_runtime import LossFn, WeightGradientHook
from d9d.pipeline._timed_action import TimedAction
from d9d.pipeline._tree import TensorSpec, TreeSpec, split_microbatches
from d9d.pipeline._validator import PipelineProgramError, validate_program

__all__ = [
    "Action",
    "ActionCosts",
    "ActionKind",
    "DualPipeVScheduleConfig",
    "ForwardOnlyScheduleConfig",
    "GPipeScheduleConfig",
    "Interleaved1F1BScheduleConfig",
    "InterleavedZeroBubbleScheduleConfig",
    "LocalPipelineExecutor",
    "LoopedBFSScheduleConfig",
    "LossFn",
    "OneFOneBScheduleConfig",
    "OverlapPoint",
    "OverlapPoints",
    "PipelineExecutor",
    "PipelineOutputMeta",
    "PipelineProgram",
    "PipelineProgramError",
    "PipelineScheduleBuilder",
    "PipelineScheduleConfig",
    "PipelineShapeError",
    "PipelineStageInfo",
    "SimulationResult",
    "StagesLRScheduler",
    "StagesOptimizer",
    "TensorSpec",
    "TimedAction",
    "TreeSpec",
    "WeightGradientHook",
    "ZBVScheduleConfig",
    "assign_layers",
    "backward",
    "backward_input",
    "backward_weight",
    "build_1f1b_program",
    "build_dualpipev_program",
    "build_forward_only_program",
    "build_gpipe_program",
    "build_interleaved_1f1b_program",
    "build_interleaved_zero_bubble_program",
    "build_looped_bfs_program",
    "build_program",
    "build_zbv_program",
    "draw_timeline_png",
    "draw_timeline_text",
    "forward",
    "insert_communication",
    "layers_of_stage",
    "make_program",
    "simulate_program",
    "split_microbatches",
    "stages_for_rank",
    "stages_per_rank",
    "validate_program",
]
