#!/usr/bin/env bash
# Session 28's second device run (one H200 host, 16 cores, Python 3.12.3), after the
# zero-copy review fixes: acoll, acoll on registered buffers and Open MPI in the same
# processes at 2, 4 and 8 ranks (bench/lane_vs_mpi_pair.py; the first run's 8-rank pass
# met the stale-pending race), then the whole suite with the GPU tests.
# OUT=dir bash bench/session28_device2.sh
SUITE_LIMIT=${SUITE_LIMIT:-300} PERF= bash bench/session28_device.sh
