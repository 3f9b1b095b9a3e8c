"""Network discovery: which local interfaces acoll binds and advertises."""

from __future__ import annotations
