"""Data transports behind one small interface (see :mod:`.base`)."""
