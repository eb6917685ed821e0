"""d9d training loop: typed contracts, configs, the trainer, checkpointing and export."""

__all__: list[str] = []
