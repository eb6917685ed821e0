"""d9d pipeline parallelism: schedules as programs, executors and a simulator."""

__all__: list[str] = []
