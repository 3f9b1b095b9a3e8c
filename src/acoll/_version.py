"""The package version (kept equal to ``project.version`` in pyproject.toml; a test checks)."""

from __future__ import annotations

__version__ = "0.1.0"
