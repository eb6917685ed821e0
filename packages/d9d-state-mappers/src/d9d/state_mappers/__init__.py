"""d9d state mappers: stream checkpoints through mapper graphs in bounded memory."""

__all__: list[str] = []
