#!/usr/bin/env bash
# Run the command; for rank 0 under py-spy (native frames and idle time) when SPY_OUT is set.
if [ "${ACOLL_RANK:-}" = "0" ] && [ -n "${SPY_OUT:-}" ] && command -v py-spy >/dev/null; then
  exec py-spy record --native --idle -r 1000 -f raw -o "$SPY_OUT" -- "$@"
fi
exec "$@"
