"""Who talks to whom: the rank arithmetic shared by algorithms, bootstrap and checks.

Pure functions of ``(rank, n[, root])``; no I/O.

- Ring: rank ``r`` sends to ``r + 1`` and receives from ``r - 1`` (mod ``n``).
- Binomial tree rooted at ``root``: with ``rel = (r - root) mod n``, the parent clears the
  lowest set bit of ``rel``; the children are ``rel + 2**k`` for every ``2**k`` below that
  bit (and below ``n``). ``ceil(log2 n)`` levels.
- Dissemination: round ``k`` pairs rank ``r`` with ``r + 2**k`` (to) and ``r - 2**k``
  (from); ``ceil(log2 n)`` rounds give every rank word of every other.
- Recursive doubling over ``p`` (the largest power of two <= n) ranks, the first
  ``2 (n - p)`` ranks folded in pairs first (see :class:`RecursiveDoubling`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RecursiveDoubling", "Tree", "binomial_tree", "dissemination", "ring"]


def ring(rank: int, n: int) -> tuple[int, int]:
    """``(next, previous)`` rank around the ring."""
    return (rank + 1) % n, (rank - 1) % n


@dataclass(frozen=True)
class Tree:
    """A rank's place in a binomial tree: ``parent`` (``None`` at the root) and
    ``children``, largest subtree first (the order a broadcast feeds them)."""

    parent: int | None
    children: tuple[int, ...]


def binomial_tree(rank: int, n: int, root: int = 0) -> Tree:
    """This rank's parent and children in the binomial tree rooted at ``root``."""
    rel = (rank - root) % n
    parent = None
    mask = 1
    while mask < n:
        if rel & mask:
            parent = (rank - mask) % n
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if rel + mask < n:
            children.append((rank + mask) % n)
        mask >>= 1
    return Tree(parent, tuple(children))


def dissemination(rank: int, n: int) -> list[tuple[int, int]]:
    """Per round ``k``: ``(rank + 2**k, rank - 2**k)`` mod ``n`` (send to, receive from)."""
    rounds = []
    dist = 1
    while dist < n:
        rounds.append(((rank + dist) % n, (rank - dist) % n))
        dist <<= 1
    return rounds


@dataclass(frozen=True)
class RecursiveDoubling:
    """A rank's role in recursive doubling over ``n`` ranks.

    With ``p`` the largest power of two <= ``n`` and ``rem = n - p``, ranks below
    ``2 rem`` pair up: the even one (``role == "even"``) hands its data to ``rank + 1`` and
    gets the result back at the end; the odd one folds it in and takes part as virtual
    rank ``rank // 2``. Ranks from ``2 rem`` on are virtual rank ``rank - rem``
    (``"plain"``). ``partners`` are the real ranks of the exchanges, one per round.
    """

    role: str
    partners: tuple[int, ...]

    @classmethod
    def of(cls, rank: int, n: int) -> RecursiveDoubling:
        p = 1 << (n.bit_length() - 1)
        rem = n - p
        if rank < 2 * rem:
            role = "even" if rank % 2 == 0 else "odd"
            vrank = -1 if rank % 2 == 0 else rank // 2
        else:
            role, vrank = "plain", rank - rem
        partners = []
        if vrank >= 0:
            mask = 1
            while mask < p:
                v = vrank ^ mask
                partners.append(v * 2 + 1 if v < rem else v + rem)
                mask <<= 1
        return cls(role, tuple(partners))
