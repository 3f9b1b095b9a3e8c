"""Planning P2P collectives: the launches ("steps") of one call, with no CUDA in sight.

A collective on ``count`` elements becomes one or more steps, each fitting the per-rank
workspace (``capacity`` bytes) in copy mode. Every rank computes the same plan from the
same arguments, so epochs, grids and descriptors agree without talking; a rank whose
arguments differ publishes a different descriptor and every rank's kernel reports the
mismatch (:func:`describe` turns a descriptor back into words).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._cuda.p2p_kernels import MAX_BLOCKS, THREADS, Mode

__all__ = ["Piece", "Step", "blocks_for", "describe", "pack_sig", "plan"]

_NAMES = {Mode.ALL_REDUCE_ONE_SHOT: "all_reduce", Mode.ALL_REDUCE_TWO_SHOT: "all_reduce",
          Mode.REDUCE_SCATTER: "reduce_scatter", Mode.REDUCE: "reduce",
          Mode.ALL_GATHER: "all_gather", Mode.BROADCAST: "broadcast",
          Mode.ALL_TO_ALL: "all_to_all"}
#: Bytes a block should have to move before another block pays off.
BLOCK_BYTES = THREADS * 16 * 2


@dataclass(frozen=True, slots=True)
class Piece:
    """Copy ``count`` elements from the user input at element ``src`` into this rank's
    workspace at element ``dst`` (copy mode, before the launch)."""

    dst: int
    src: int
    count: int


@dataclass(frozen=True, slots=True)
class Step:
    """One launch. Offsets and counts in elements (bytes for the copy kernel)."""

    mode: int
    index: int
    n: int  # elements per rank this step
    in_off: int  # into the user input
    out_off: int  # into the user output
    out_stride: int
    src_stride: int  # between rank blocks in a workspace
    user_stride: int  # between rank blocks in a user input
    pieces: tuple[Piece, ...]  # what a rank reading from its workspace copies there first
    blocks: int


def blocks_for(nbytes: int, most: int) -> int:
    """Blocks for a step moving ``nbytes`` per rank (the same on every rank)."""
    return max(1, min(most, MAX_BLOCKS, -(-nbytes // BLOCK_BYTES)))


def pack_sig(mode: int, dtype_code: int, op: int, root: int, index: int) -> int:
    """The first descriptor word of a step (the second is the call's total count)."""
    return (mode & 0xFF) | (dtype_code & 0xFF) << 8 | (op & 0xFF) << 16 | (
        root & 0xFFFF) << 24 | (index & 0xFFFFFF) << 40


def describe(sig: int, count: int, dtype_names: dict[int, str]) -> str:
    """Words for a descriptor: ``"all_reduce of 1024 x float32 (op 0), step 2"``."""
    mode, code, op = sig & 0xFF, sig >> 8 & 0xFF, sig >> 16 & 0xFF
    root, index = sig >> 24 & 0xFFFF, sig >> 40
    what = _NAMES.get(mode, f"mode {mode}")
    extra = f", root {root}" if mode in (Mode.BROADCAST, Mode.REDUCE) else ""
    extra += f", op {op}" if mode in Mode.REDUCING else ""
    return (f"{what} of {count} x {dtype_names.get(code, f'dtype {code}')}{extra}, "
            f"step {index}")


def _spans(total: int, per_step: int) -> list[tuple[int, int]]:
    per_step = max(1, per_step)
    return [(k, min(per_step, total - k)) for k in range(0, total, per_step)]


def plan(mode: int, count: int, itemsize: int, nranks: int, rank: int, root: int, *,
         capacity: int | None, most_blocks: int) -> list[Step]:
    """The steps of one call (the same count and sizes on every rank).

    ``count``: elements per rank's input for all_reduce/reduce/broadcast, per rank's block
    for all_gather (input), reduce_scatter (output) and all_to_all (each peer's block).
    ``capacity``: workspace bytes per rank: a step never holds more, so that every rank
    can take its workspace for any call (ranks reading user buffers in place just skip
    the pieces); ``None``: one step (no rank will use its workspace).
    """
    if count <= 0:
        return []
    # Keep step boundaries on 16-byte multiples so every step stays vector-aligned.
    align = max(1, 16 // itemsize) if itemsize <= 16 else 1
    share = nranks if mode in (Mode.REDUCE_SCATTER, Mode.ALL_TO_ALL) else 1
    per_step = count if capacity is None else capacity // (itemsize * share) // align * align
    if per_step <= 0:
        raise ValueError(f"workspace of {capacity} bytes cannot hold a step")
    steps = []
    for index, (k0, c) in enumerate(_spans(count, per_step)):
        pieces: tuple[Piece, ...] = ()
        out_stride = src_stride = user_stride = 0
        if mode in (Mode.REDUCE_SCATTER, Mode.ALL_TO_ALL):
            out_stride = count if mode == Mode.ALL_TO_ALL else 0
            src_stride, user_stride = c, count
            pieces = tuple(Piece(q * c, q * count + k0, c) for q in range(nranks))
        elif mode == Mode.ALL_GATHER:
            out_stride = count
            pieces = (Piece(0, k0, c),)
        elif mode == Mode.BROADCAST:
            if rank == root:
                pieces = (Piece(0, k0, c),)
        else:
            pieces = (Piece(0, k0, c),)
        steps.append(Step(mode, index, c, k0, k0, out_stride, src_stride, user_stride,
                          pieces, blocks_for(c * itemsize, most_blocks)))
    return steps
