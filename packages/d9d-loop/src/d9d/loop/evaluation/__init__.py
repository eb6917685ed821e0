"""Evaluation during training: the forward-only pass over held-out data and its wiring into a job.

Private: the public names are re-exported from ``d9d.loop``.
"""
