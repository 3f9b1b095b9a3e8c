"""``acoll-perf``: nccl-tests-style bandwidth and latency sweeps (also ``python -m acoll.perf``).

Usage::

    acoll-perf all_reduce -N 4 -b 8 -e 256M -f 2 -n 20 -w 5 -d float32 -o sum [--vs gloo]

Collectives: ``all_reduce broadcast reduce all_gather reduce_scatter all_to_all sendrecv
barrier``, and ``tcp``: the raw TCP ceiling (every rank sends SIZE bytes to its ring successor
and receives SIZE bytes from its predecessor over plain blocking sockets, full duplex like one
ring step), reported as busbw so it compares with 2-rank all_reduce busbw.

Semantics follow nccl-tests:

* ``-b/-e`` are bytes of the largest buffer one op touches: for all_gather the gathered
  output, for reduce_scatter the full input, for all_to_all the whole send buffer; ``count``
  is the op's count argument (per-rank block for all_gather/reduce_scatter/all_to_all).
* time: a barrier, then ``-n`` back-to-back ops, averaged; combined over ranks (``-a``:
  max by default). ``-w`` warm-up ops precede every size.
* ``algbw = size / time``; ``busbw = algbw * factor`` with nccl-tests' PERFORMANCE.md factors:
  all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; the rest 1.
* ``#wrong``: after the timed loop the op runs once more on freshly filled buffers (values
  exact in the dtype, depending on rank and index) and the output is compared with a NumPy
  reference; the count of mismatching elements is summed over ranks.
* out-of-place and in-place columns (``--no-inplace`` drops the latter). acoll's broadcast is
  in place only, so its out-of-place column broadcasts into a separate buffer. Modes a
  backend refuses (e.g. torch's all_to_all_single in place) print ``N/A``.

Ranks: ``-N n`` starts n local ranks through acoll-run's launcher; otherwise a launcher's
variables (acoll-run, torchrun, Slurm, MPI: :func:`acoll.init_from_env`), else one rank.
``--vs gloo|nccl`` repeats the sweep with ``torch.distributed`` in separate processes (with
``-N``) and prints a comparison; torch's out-of-place all_reduce/reduce is ``copy_`` plus
the in-place op, so ratios use in-place results where both sides have them. ``--vs mpi``
does the same with MPI through mpi4py (``-N``: ``mpirun -np n``; or in the processes of a
job mpirun started); see :mod:`.backends.mpi`. With ``-N``, ``--rounds R`` runs the pair
of jobs R times in alternating order and reports per-record medians and each round's ratio
(median, min..max): on machines whose speed drifts between minutes, one acoll sweep and one
peer sweep can differ by more than the libraries do.

Package layout: :mod:`.cli` (options, starting ranks), :mod:`.sweep` (sizes, timing, the
result check), :mod:`.colls` (every per-collective rule, one table), :mod:`.report` (tables,
comparison, JSON, plots), :mod:`.buffers` (where test memory lives) and :mod:`.backends`
(acoll, raw TCP, torch.distributed, MPI).
"""

from __future__ import annotations

from .cli import main
from .colls import COLLECTIVES, bus_factor
from .colls import counts as _counts  # noqa: F401 - the names perf.py had, for tests
from .sweep import count_wrong, sweep_sizes
from .sweep import expected as _expected  # noqa: F401
from .sweep import values as _values  # noqa: F401

__all__ = ["COLLECTIVES", "bus_factor", "count_wrong", "main", "sweep_sizes"]
