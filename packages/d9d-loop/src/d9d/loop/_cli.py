"""``python -m d9d.loop._cli``: the ``d9d`` command (its entry point is ``d9d._loop_command``).

``lr-plot`` (the configured LR schedule), ``plot`` (a run's metrics), ``inspect`` (a checkpoint
or an export), ``export`` (a DCP checkpoint to a Hugging Face directory). The console script
points at ``d9d._loop_command:main``, outside this package, so that ``--help`` does not import
torch; this module stays for ``python -m`` and existing imports.
"""

from __future__ import annotations

import sys

from d9d._loop_command import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
