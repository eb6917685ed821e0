"""Repository-wide pytest setup.

d9d-mesh registers its pytest plugin (the clean zygote that test ranks are forked from) through
an entry point when installed. Where the packages are used from source on ``PYTHONPATH`` (the GPU
machine), no entry point exists, so register the plugin here.
"""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    from d9d.mesh.testing import _pytest_plugin

    if not config.pluginmanager.is_registered(_pytest_plugin):
        config.pluginmanager.register(_pytest_plugin, "d9d_mesh_from_source")
