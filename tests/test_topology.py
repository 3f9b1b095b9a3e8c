"""Rank arithmetic (:mod:`acoll._topology`) checked against its defining properties."""

from __future__ import annotations

import pytest

from acoll import _topology as topo

SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 100]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("root_pick", [0, 1, -1])
def test_binomial_tree_is_a_tree_rooted_at_root(n: int, root_pick: int) -> None:
    root = root_pick % n
    trees = [topo.binomial_tree(r, n, root) for r in range(n)]
    assert trees[root].parent is None
    for r, tree in enumerate(trees):
        for child in tree.children:
            assert trees[child].parent == r  # parent and child agree
        if r != root:
            assert tree.parent is not None
            assert r in trees[tree.parent].children
    # every rank reaches the root; depth at most ceil(log2 n)
    for r in range(n):
        hops, at = 0, r
        while at != root:
            parent = trees[at].parent
            assert parent is not None
            at, hops = parent, hops + 1
        assert hops <= max(0, (n - 1).bit_length())


@pytest.mark.parametrize("n", SIZES)
def test_dissemination_reaches_everyone(n: int) -> None:
    # after the rounds, rank r has heard (transitively) from every rank
    knows = [{r} for r in range(n)]
    rounds = [topo.dissemination(r, n) for r in range(n)]
    for k in range(len(rounds[0])):
        knows = [knows[r] | knows[rounds[r][k][1]] for r in range(n)]
        for r in range(n):
            to, frm = rounds[r][k]
            assert rounds[to][k][1] == r
            assert rounds[frm][k][0] == r
    assert all(k == set(range(n)) for k in knows)
    assert len(rounds[0]) == (n - 1).bit_length()


@pytest.mark.parametrize("n", SIZES)
def test_recursive_doubling_pairs_are_mutual_and_cover_everyone(n: int) -> None:
    plans = [topo.RecursiveDoubling.of(r, n) for r in range(n)]
    p = 1 << (n.bit_length() - 1)
    assert sum(plan.role == "even" for plan in plans) == n - p
    for r, plan in enumerate(plans):
        if plan.role == "even":
            assert plan.partners == ()
            assert plans[r + 1].role == "odd"
        for k, partner in enumerate(plan.partners):
            assert plans[partner].partners[k] == r
    # the exchanges combine every rank's data: simulate sets
    have = [{r} for r in range(n)]
    for r, plan in enumerate(plans):
        if plan.role == "odd":
            have[r] |= have[r - 1]
    rounds = len(next(pl.partners for pl in plans if pl.role != "even"))
    for k in range(rounds):
        have = [have[r] | have[plans[r].partners[k]] if plans[r].role != "even" else have[r]
                for r in range(n)]
    assert all(have[r] == set(range(n)) for r in range(n) if plans[r].role != "even")


def test_ring() -> None:
    assert topo.ring(0, 4) == (1, 3)
    assert topo.ring(3, 4) == (0, 2)
    assert topo.ring(0, 1) == (0, 0)
