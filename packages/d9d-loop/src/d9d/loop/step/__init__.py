"""One training step: forward and backward over its microbatches (plain or pipelined), gradients,
the non-finite guard and the figures a step reads back to the host.

Private: the public names are re-exported from ``d9d.loop``.
"""
