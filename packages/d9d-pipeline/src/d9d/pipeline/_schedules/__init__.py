"""Schedule builders: functions from (ranks, microbatches) to a :class:`PipelineProgram`."""
