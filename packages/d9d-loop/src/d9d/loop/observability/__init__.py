"""What watches a run: trackers, run metadata, step metrics (throughput, timing, memory, MFU),
profiler, garbage-collection control, the step watchdog and the progress bar.

Private: the public names are re-exported from ``d9d.loop``.
"""
