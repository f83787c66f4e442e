"""KVCache bookkeeping: positions and masks of appended chains/trees, commit, rollback, truncate.

The end-to-end checks run the tiny native model: a token tree forwarded in one
or several appends must give, at every node, the logits of a fresh cache fed the
plain sequence prompt + path-to-node; after ``commit(path)`` the next forward
must equal a fresh cache fed prompt + committed path (fp32; max abs diff < 1e-5
times the logit scale max(1, max |logit|): the tiny model's logits reach ~20, so
plain fp32 rounding alone gives ~1e-5 absolute, while a wrong mask, position or
moved slot changes logits by O(1)).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.models.kv_cache import KVCache

TOL = 1e-5  # relative to the logit scale (|logits| reach ~20 here; fp32 rounding is ~1e-6 of that)
HSET = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cache(max_len=64, max_pending=32, layers=2, heads=2, dim=4):
    return KVCache(layers, heads, dim, max_len, max_pending=max_pending)


def _ancestors(parents: list[int], j: int) -> set[int]:
    out = set()
    while j >= 0:
        out.add(j)
        j = parents[j]
    return out


def _reference_mask(length: int, parents: list[int], new: range) -> torch.Tensor:
    """Brute force: row j may see every committed slot and its pending ancestors-or-self."""
    total = length + len(parents)
    m = torch.zeros(len(new), total, dtype=torch.bool)
    m[:, :length] = True
    for r, j in enumerate(new):
        for a in _ancestors(parents, j):
            m[r, length + a] = True
    return m


def _depth(parents: list[int], j: int) -> int:
    return len(_ancestors(parents, j)) - 1


# ---------------------------------------------------------------------------
# strategies


@st.composite
def trees(draw, max_nodes=16):
    """Parent lists (parents precede children), split into consecutive append chunks."""
    n = draw(st.integers(1, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3)))) if n > 1 else []
    bounds = [0] + cuts + [n]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    return parents, chunks


def _chunk_parents(parents, a, b, allow_none: bool):
    """Parents for an append of nodes a..b-1; ``None`` where that chunk is a plain continuation."""
    ps = parents[a:b]
    is_cont = all(p == a + i - 1 for i, p in enumerate(ps))
    if allow_none and is_cont:
        return None
    return ps


# ---------------------------------------------------------------------------
# plan_append: positions and masks


def test_chain_on_empty_cache_is_causal():
    c = _cache()
    pos, mask = c.plan_append(None, 5)
    assert pos.tolist() == [0, 1, 2, 3, 4]
    assert mask is None
    assert c.n_pending == 5 and c.length == 0 and c.total == 5 and c.room() == 59


def test_chain_after_committed_and_after_pending_chain():
    c = _cache()
    c.plan_append(None, 4)
    c.commit()
    assert c.length == 4 and c.n_pending == 0
    pos, mask = c.plan_append(None, 3)
    assert pos.tolist() == [4, 5, 6] and mask is None
    pos, mask = c.plan_append(None, 2)  # continues the pending chain
    assert pos.tolist() == [7, 8] and mask is None
    assert c._parents == [-1, 0, 1, 2, 3]
    c.commit()
    assert c.length == 9


def test_tree_positions_and_mask_by_hand():
    c = _cache()
    c.plan_append(None, 3)
    c.commit()
    #        root(committed)
    #        /      \
    #       0        1
    #      / \       |
    #     2   3      4
    parents = [-1, -1, 0, 0, 1]
    pos, mask = c.plan_append(parents, 5)
    assert pos.tolist() == [3, 3, 4, 4, 4]
    expect = torch.tensor([
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expect)
    # a chain appended after a branched pending tree continues node 4 and needs a mask
    pos, mask = c.plan_append(None, 2)
    assert pos.tolist() == [5, 6]
    assert mask is not None
    assert torch.equal(mask, _reference_mask(3, c._parents, range(5, 7)))
    assert c._parents[5:] == [4, 5]


def test_explicit_chain_parents_still_exact():
    c = _cache()
    pos, mask = c.plan_append([-1, 0, 1], 3)
    assert pos.tolist() == [0, 1, 2]
    if mask is not None:
        assert torch.equal(mask, torch.ones(3, 3, dtype=torch.bool).tril())


@settings(max_examples=150, **HSET)
@given(tree=trees(max_nodes=20), committed=st.integers(0, 10), use_none=st.booleans())
def test_positions_and_masks_match_brute_force(tree, committed, use_none):
    parents, chunks = tree
    c = _cache(max_len=64, max_pending=32)
    if committed:
        c.plan_append(None, committed)
        c.commit()
    for a, b in chunks:
        ps = _chunk_parents(parents, a, b, use_none)
        pos, mask = c.plan_append(ps, b - a)
        assert c._parents == parents[:b]
        assert pos.tolist() == [committed + _depth(parents, j) for j in range(a, b)]
        ref = _reference_mask(committed, parents[:b], range(a, b))
        if mask is None:
            # only allowed where plain causal attention is exact: everything pending is a chain
            assert all(p == i - 1 for i, p in enumerate(parents[:b]))
        else:
            assert mask.shape == (b - a, committed + b)
            assert torch.equal(mask.cpu(), ref)
    assert c.n_pending == len(parents) and c.total == committed + len(parents)


def test_stale_ancestor_rows_do_not_leak_between_trees():
    """The ancestor matrix is reused across trees; a new tree must not inherit old relations."""
    c = _cache(max_pending=8)
    c.plan_append([-1, 0, 1, 2, 3, 4, 5, 6], 8)  # one deep chain: row 7 sees everything
    c.rollback()
    parents = [-1, -1, -1, -1, -1, -1, -1, 6]  # a flat tree, then a child of node 6
    _, mask = c.plan_append(parents[:7], 7)
    assert torch.equal(mask, _reference_mask(0, parents[:7], range(7)))
    _, mask = c.plan_append(parents[7:], 1)
    assert torch.equal(mask, _reference_mask(0, parents, range(7, 8)))


# ---------------------------------------------------------------------------
# commit / rollback / truncate on marked slots


def _mark(c: KVCache) -> None:
    """Slot s holds value s in K and -s in V (every layer, head, dim)."""
    idx = torch.arange(c.max_len, dtype=c.k.dtype).view(1, 1, 1, -1, 1)
    c.k.copy_(idx.expand_as(c.k))
    c.v.copy_((-idx).expand_as(c.v))


def _slot_values(c: KVCache) -> list[float]:
    return c.k[0, 0, 0, :, 0].tolist()


@settings(max_examples=150, **HSET)
@given(tree=trees(max_nodes=20), committed=st.integers(0, 10), data=st.data())
def test_commit_moves_only_kept_slots(tree, committed, data):
    parents, _ = tree
    c = _cache(max_len=64, max_pending=32)
    if committed:
        c.plan_append(None, committed)
        c.commit()
    c.plan_append(parents, len(parents))
    _mark(c)
    before = _slot_values(c)
    node = data.draw(st.integers(-1, len(parents) - 1), label="path end (-1 = keep nothing)")
    path = sorted(_ancestors(parents, node)) if node >= 0 else []
    c.commit(path)
    after = _slot_values(c)
    assert c.length == committed + len(path) and c.n_pending == 0
    expect = list(before)
    for i, nd in enumerate(path):
        expect[committed + i] = before[committed + nd]
    assert after == expect  # kept slots moved into place, every other slot untouched
    assert torch.equal(c.v, -c.k)  # V moved together with K
    # every layer/head/dim moved, not just the probed one
    ref = torch.tensor(expect, dtype=c.k.dtype).view(1, 1, 1, -1, 1).expand_as(c.k)
    assert torch.equal(c.k, ref)


def test_commit_of_chain_in_place_copies_nothing(monkeypatch):
    c = _cache()
    c.plan_append([-1, 0, 1, -1], 4)
    calls = []
    orig = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    c.commit([0, 1, 2])
    assert calls == [] and c.length == 3


def test_rollback_and_reset_drop_pending_only():
    c = _cache()
    c.plan_append(None, 3)
    c.commit()
    c.plan_append([-1, -1, 0], 3)
    c.rollback()
    assert c.length == 3 and c.n_pending == 0 and c.total == 3
    pos, mask = c.plan_append(None, 2)
    assert pos.tolist() == [3, 4] and mask is None
    c.reset()
    assert c.length == 0 and c.n_pending == 0 and c.room() == c.max_len


def test_truncate():
    c = _cache()
    c.plan_append(None, 6)
    c.commit()
    c.plan_append([-1, -1], 2)
    c.truncate(4)
    assert c.length == 4 and c.n_pending == 0
    pos, _ = c.plan_append(None, 1)
    assert pos.tolist() == [4]
    c.rollback()
    c.truncate(4)  # same length: fine
    c.truncate(0)
    assert c.length == 0
    with pytest.raises(ValueError):
        c.truncate(1)  # cannot grow
    with pytest.raises(ValueError):
        c.truncate(-1)


# ---------------------------------------------------------------------------
# errors


def test_capacity_exceeded_raises_and_leaves_state():
    c = _cache(max_len=8)
    c.plan_append(None, 5)
    c.commit()
    c.plan_append([-1], 1)
    with pytest.raises(ValueError, match="full"):
        c.plan_append(None, 3)  # 6 + 3 > 8
    assert c.length == 5 and c.n_pending == 1
    c.plan_append(None, 2)  # exactly full is fine
    assert c.room() == 0
    with pytest.raises(ValueError):
        c.plan_append(None, 1)


def test_too_many_pending_raises():
    c = _cache(max_len=64, max_pending=4)
    c.plan_append(None, 3)
    with pytest.raises(ValueError, match="pending"):
        c.plan_append(None, 2)
    assert c.n_pending == 3


@pytest.mark.parametrize("parents", [[0], [-2], [-1, 1], [-1, 5], [1, -1]])
def test_bad_parent_raises(parents):
    c = _cache()
    with pytest.raises(ValueError):
        c.plan_append(parents, len(parents))


def test_bad_append_arguments():
    c = _cache()
    with pytest.raises(ValueError):
        c.plan_append([-1, 0], 3)  # parents / tokens count mismatch
    with pytest.raises(ValueError):
        c.plan_append(None, 0)
    assert c.n_pending == 0


def test_bad_parent_leaves_cache_unchanged():
    """A rejected append must not leave half-registered nodes behind."""
    c = _cache()
    c.plan_append([-1, 0], 2)
    with pytest.raises(ValueError):
        c.plan_append([-1, 0, 9], 3)  # third parent is invalid
    assert c.n_pending == 2, "nodes of a rejected append stayed registered"
    assert c._parents == [-1, 0]


@pytest.mark.parametrize("path", [[1], [0, 2], [0, 1, 3], [2, 3], [5], [-1], [0, 0]])
def test_non_chain_commit_path_raises(path):
    c = _cache()
    # pending: 0 <- 1 <- 2 ; 3 is a second root child ; 4 child of 3
    c.plan_append([-1, 0, 1, -1, 3], 5)
    with pytest.raises(ValueError):
        c.commit(path)


def test_commit_all_requires_a_chain():
    c = _cache()
    c.plan_append([-1, -1], 2)
    with pytest.raises(ValueError):
        c.commit()


# ---------------------------------------------------------------------------
# against recomputation with the tiny native model


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference in units of the logit scale (max(1, max |ref|))."""
    return (out - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def _fresh_logits(model, seq: list[int]) -> torch.Tensor:
    cache = model.new_cache(max_len=len(seq) + 1)
    return model.forward(torch.tensor(seq)[None], cache)[0]


@pytest.fixture(scope="module")
def native(tiny):
    return tiny(seed=0).model


@settings(max_examples=60, **HSET)
@given(
    prompt=st.lists(st.integers(0, 258), min_size=1, max_size=24),
    tree=trees(max_nodes=12),
    tree2=trees(max_nodes=6),
    data=st.data(),
)
def test_tree_forward_and_commit_match_recomputation(native, prompt, tree, tree2, data):
    model = native
    cache = model.new_cache(max_len=96)
    model.forward(torch.tensor(prompt)[None], cache)
    cache.commit()
    seq = list(prompt)
    for parents, chunks in (tree, tree2):
        tokens = data.draw(st.lists(st.integers(0, 258), min_size=len(parents), max_size=len(parents)),
                           label="tree tokens")
        rows = []
        for a, b in chunks:
            ps = _chunk_parents(parents, a, b, allow_none=data.draw(st.booleans(), label="chain as None"))
            rows.append(model.forward(torch.tensor(tokens[a:b])[None], cache, parents=ps)[0])
        logits = torch.cat(rows)
        # every node sees exactly the committed sequence plus its ancestors
        for j in range(len(parents)):
            path = sorted(_ancestors(parents, j))
            ref = _fresh_logits(model, seq + [tokens[i] for i in path])[-1]
            diff = _rel_diff(logits[j], ref)
            assert diff < TOL, f"node {j} (path {path}): relative max abs diff {diff}"
        node = data.draw(st.integers(-1, len(parents) - 1), label="commit path end")
        path = sorted(_ancestors(parents, node)) if node >= 0 else []
        cache.commit(path)
        seq += [tokens[i] for i in path]
        assert cache.length == len(seq)
    nxt = data.draw(st.lists(st.integers(0, 258), min_size=1, max_size=3), label="next tokens")
    out = model.forward(torch.tensor(nxt)[None], cache)[0]
    ref = _fresh_logits(model, seq + nxt)[-len(nxt):]
    diff = _rel_diff(out, ref)
    assert diff < TOL, f"after commits: relative max abs diff {diff}"


def test_rollback_and_truncate_match_recomputation(native):
    model = native
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 259, (12,), generator=g).tolist()
    cache = model.new_cache(max_len=64)
    model.forward(torch.tensor(prompt)[None], cache)
    cache.commit()
    model.forward(torch.tensor([[7, 8, 9, 10]]), cache, parents=[-1, -1, 1, 2])
    cache.rollback()
    out = model.forward(torch.tensor([[3, 4]]), cache)[0]
    assert _rel_diff(out, _fresh_logits(model, prompt + [3, 4])[-2:]) < TOL
    cache.commit()
    cache.truncate(7)
    out = model.forward(torch.tensor([[5]]), cache)[0]
    assert _rel_diff(out, _fresh_logits(model, prompt[:7] + [5])[-1:]) < TOL
