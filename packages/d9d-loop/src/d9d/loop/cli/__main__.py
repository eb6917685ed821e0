"""``python -m d9d.loop.cli``: the ``d9d`` command (its entry point is ``d9d._loop_command``).

``lr-plot`` (the configured LR schedule), ``plot`` (a run's metrics), ``inspect`` (a checkpoint
or an export), ``export`` (a DCP checkpoint to a Hugging Face directory), ``estimate``
(each rank's peak device memory from a config). The console script
points at ``d9d._loop_command:main``, outside this package, so that ``--help`` does not import
torch; this module serves ``python -m`` (the integration tests run the command this way).
"""

from __future__ import annotations

import sys

from d9d._loop_command import main

if __name__ == "__main__":
    sys.exit(main())
