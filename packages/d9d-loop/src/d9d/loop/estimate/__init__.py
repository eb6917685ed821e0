"""Each rank's peak device memory, predicted from the job's config before anything is built."""

from d9d.loop.estimate._describe import DescribeMemoryContext, DescribeMemoryResult
from d9d.loop.estimate._device_budget import device_budget_bytes
from d9d.loop.estimate._estimate import ALLOCATOR_SLACK, COMPONENTS, RankEstimate, estimate_memory
from d9d.loop.estimate._fit import MemoryFitError, check_fits, fitting_switches
from d9d.loop.estimate._job import MemoryJob, OptimizerMemory, optimizer_memory
from d9d.loop.estimate._report import format_table, summary_line
from d9d.loop.estimate._shape import LinearShape, ModelMemoryShape

__all__ = [
    "ALLOCATOR_SLACK",
    "COMPONENTS",
    "DescribeMemoryContext",
    "DescribeMemoryResult",
    "LinearShape",
    "MemoryFitError",
    "MemoryJob",
    "ModelMemoryShape",
    "OptimizerMemory",
    "RankEstimate",
    "check_fits",
    "device_budget_bytes",
    "estimate_memory",
    "fitting_switches",
    "format_table",
    "optimizer_memory",
    "summary_line",
]
