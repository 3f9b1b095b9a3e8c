"""The intra-host GPU path: kernels that read peers' GPU memory directly.

:mod:`.plan` (steps of a call, no CUDA), :mod:`.domain` (workspaces mapped across ranks
by peer access or CUDA IPC, launches, errors), :mod:`.ops` (a call as an executor
algorithm). Kernel sources live in :mod:`acoll._cuda.p2p_kernels`.
"""
