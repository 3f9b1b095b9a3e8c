"""Collective algorithms: set-up first, then a loop that only moves data."""
