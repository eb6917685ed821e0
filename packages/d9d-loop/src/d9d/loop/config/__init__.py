"""Configuration models of a training job: trainer, project, data, optimizer, LR schedule,
evaluation, trackers and observability.

Private: the public names are re-exported from ``d9d.loop``.
"""
