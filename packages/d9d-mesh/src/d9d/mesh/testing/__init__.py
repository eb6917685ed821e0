"""Multi-rank CPU testing: run a function on N gloo ranks forked from the test process."""

from d9d.mesh.testing._runner import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
