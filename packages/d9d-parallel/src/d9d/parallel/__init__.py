"""d9d parallelism: replicate, FSDP/HSDP, TP, CP, EP, gradient sync and clipping."""

__all__: list[str] = []
