"""The communicator's parts: peer connections, op execution, order checks, agreement,
argument adaptation. :mod:`acoll._communicator` puts them together."""
