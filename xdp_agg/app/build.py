"""What this installation is: the distribution's version (`xdp-agg --version`, the metrics'
xdpagg_build_info)."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "xdp-agg"


def version() -> str | None:
    """The installed distribution's version (pyproject.toml); None in a bare checkout."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
