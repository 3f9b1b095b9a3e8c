"""``python -m acoll._native``: build the native ring now (``make venv`` does)."""
from __future__ import annotations

import sys

from . import load

built = load()
print(built.path if built is not None else "native ring unavailable", file=sys.stderr)
sys.exit(0 if built is not None else 1)
