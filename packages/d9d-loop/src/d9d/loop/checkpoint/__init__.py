"""Checkpointing: what a checkpoint holds, how it is written, verified, resumed from and rolled back to.

Private: the public names are re-exported from ``d9d.loop``.
"""
