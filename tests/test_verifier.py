"""The verifier: greedy path selection and the exactness of (recursive) rejection sampling.

Greedy: against a brute-force reference on hand-built and random trees.

Sampling: ``verify`` is called directly, many times, on a tiny vocabulary with a
fixed target p and draft q; the emitted tokens are compared with the exact target
distribution by a chi-square goodness-of-fit test at alpha = 0.01.  A planted
error (acceptance min(1, q/p) instead of min(1, p/q), and two subtler ones) run
through the same harness must be rejected, which shows the test has power.

Power (single-token tests: N = 12_000 draws, V = 8, df <= 7).  Moving delta = 0.02
of probability mass from one bin to another, both with p <= 0.25 (true of every
bin of the target P8), gives the Pearson statistic a noncentrality
lambda = N * sum(d_i^2 / p_i) >= 12_000 * 2 * 0.02^2 / 0.25 = 38.4.
The 0.99 quantile of chi2(7) is 18.5; a noncentral chi2(7, 38.4) has mean 45.4
and sd sqrt(2 * (7 + 2 * 38.4)) = 12.9, so the shift is detected with
probability ~0.98 (normal approximation; ~1 for bins near p = 1/8, lambda = 77).
``test_chi2_helper_detects_a_two_percent_shift`` checks this empirically.
Depth-2 joint test: N = 15_000 over <= 36 cells; a 0.02 shift between two cells
with p <= 0.1 gives lambda >= 120 against a 0.99 quantile of 57.3 (df 35):
mean 155, sd 24, power ~1.  Seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.core.sampling import SamplingParams, target_probs
from leapdecode.core.tree import TokenTree
from leapdecode.core.verifier import Verdict, verify
from leapdecode.errors import InvalidParameterError

ALPHA = 0.01
N = 12_000
HSET = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ===========================================================================
# greedy


def _row(v: int, best: int, V: int = 6) -> list[float]:
    r = [0.0] * V
    r[best] = 5.0
    return r


def test_greedy_hand_built_tree():
    V = 6
    #            root  (argmax 1)
    #          /   |    \
    #       n0:3  n1:1  n2:1(dup, ignored: n1 comes first)
    #              |  \
    #            n3:2 n4:4          row(n1) argmax 4
    #                  |
    #                 n5:0          row(n4) argmax 0, row(n5) argmax 5
    tree = TokenTree()
    tree.add(3, -1)
    tree.add(1, -1)
    tree.add(1, -1)
    tree.add(2, 1)
    tree.add(4, 1)
    tree.add(0, 4)
    best = [1, 0, 4, 2, 0, 0, 5]  # per flattened row: root, n0..n5
    logits = torch.tensor([_row(0, b, V) for b in best])
    v = verify(tree, logits, SamplingParams())
    assert v.accepted == [1, 4, 5]
    assert v.next_token == 5
    assert v.tokens == [1, 4, 0, 5]


def test_greedy_nothing_matches_and_empty_tree():
    tree = TokenTree.chain([2, 3])
    logits = torch.tensor([_row(0, 4), _row(0, 3), _row(0, 1)])
    v = verify(tree, logits, SamplingParams())
    assert (v.accepted, v.next_token, v.tokens) == ([], 4, [4])
    v = verify(TokenTree(), logits[:1], SamplingParams())
    assert (v.accepted, v.next_token, v.tokens) == ([], 4, [4])


def test_greedy_full_chain_accepted_gets_bonus_token():
    tree = TokenTree.chain([2, 3, 0])
    logits = torch.tensor([_row(0, 2), _row(0, 3), _row(0, 0), _row(0, 5)])
    v = verify(tree, logits, SamplingParams())
    assert v.accepted == [0, 1, 2] and v.tokens == [2, 3, 0, 5]


def _penalize(row: torch.Tensor, penalty: float, seen: set[int]) -> torch.Tensor:
    row = row.clone()
    for t in seen:
        row[t] = row[t] / penalty if row[t] > 0 else row[t] * penalty
    return row


def _greedy_reference(tree: TokenTree, logits: torch.Tensor, penalty: float, history: list[int],
                      allowed: torch.Tensor | None) -> tuple[list[int], int]:
    """Brute force: among all root-to-node paths, the longest whose every token is the
    (penalised, constrained) argmax after its parent; then that node's argmax."""

    def best(row_idx: int, path: list[int]) -> int:
        row = logits[row_idx].clone()
        if penalty != 1.0:
            row = _penalize(row, penalty, set(history) | {tree.tokens[n] for n in path})
        if allowed is not None:
            row[~allowed[row_idx]] = -math.inf
        return int(row.argmax())

    longest: list[int] = []
    for node in range(len(tree)):
        path = tree.path_to(node)
        ok = all(tree.tokens[n] == best(0 if i == 0 else path[i - 1] + 1, path[:i]) for i, n in enumerate(path))
        if ok and len(path) > len(longest):
            longest = path
    end_row = longest[-1] + 1 if longest else 0
    return longest, best(end_row, longest)


@st.composite
def greedy_cases(draw):
    V = draw(st.integers(2, 6))
    n = draw(st.integers(0, 14))
    tree = TokenTree()
    for _ in range(n):
        parent = draw(st.integers(-1, len(tree) - 1))
        used = {tree.tokens[c] for c in tree.children(parent)}
        free = [t for t in range(V) if t not in used]
        if not free:
            continue
        tree.add(draw(st.sampled_from(free)), parent)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    # a bias towards each node's own token makes long accepted paths common
    logits = torch.randn(len(tree) + 1, V, generator=g)
    for i, p in enumerate(tree.parents):
        if draw(st.booleans()):
            logits[p + 1, tree.tokens[i]] += 3.0
    penalty = draw(st.sampled_from([1.0, 1.0, 0.7, 1.5]))
    history = draw(st.lists(st.integers(0, V - 1), max_size=4))
    allowed = None
    if draw(st.booleans()):
        allowed = torch.rand(len(tree) + 1, V, generator=g) < 0.7
        allowed[torch.arange(len(tree) + 1), torch.randint(0, V, (len(tree) + 1,), generator=g)] = True
    return tree, logits, penalty, history, allowed


@settings(max_examples=300, **HSET)
@given(case=greedy_cases())
def test_greedy_is_longest_argmax_path(case):
    tree, logits, penalty, history, allowed = case
    params = SamplingParams(repetition_penalty=penalty)
    v = verify(tree, logits, params, history=torch.tensor(history, dtype=torch.long), allowed=allowed)
    path, nxt = _greedy_reference(tree, logits, penalty, history, allowed)
    assert v.accepted == path
    assert v.next_token == nxt
    assert v.tokens == [tree.tokens[n] for n in path] + [nxt]


# ===========================================================================
# sampling: exact distribution

V8 = 8
P8 = torch.tensor([0.22, 0.05, 0.18, 0.0, 0.12, 0.25, 0.10, 0.08])  # one token the target never emits
Q8 = torch.tensor([0.05, 0.30, 0.10, 0.15, 0.25, 0.0, 0.05, 0.10])  # draft misses target's top token
SAMPLE = SamplingParams(temperature=1.0)


def _log(p: torch.Tensor) -> torch.Tensor:
    return p.log()  # log 0 = -inf: the target gives that token probability exactly 0


def _gumbel_top_k(q: torch.Tensor, k: int, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` ordered samples of ``k`` distinct tokens drawn without replacement from ``q``."""
    keys = q.log()[None] - torch.empty(n, q.numel()).exponential_(generator=g).log()
    return keys.topk(k, dim=-1).indices


def _first_tokens(verify_fn, make_tree, logits, params, n=N, seed=0, k=1, q=Q8):
    """Histogram of the first emitted token over ``n`` independent verifications."""
    g_draft = torch.Generator().manual_seed(10_000 + seed)
    g = torch.Generator().manual_seed(seed)
    draws = _gumbel_top_k(q, k, n, g_draft).tolist() if k else [[]] * n
    counts = torch.zeros(logits.shape[-1])
    for toks in draws:
        tree = make_tree(toks)
        v = verify_fn(tree, logits, params, None, g)
        counts[v.tokens[0]] += 1
    return counts


def _sampled_children(q: torch.Tensor, extra_det: list[int] = ()):
    def make(toks):
        tree = TokenTree()
        for t in toks:
            tree.add(t, -1, sampled=True)
        tree.q[-1] = q
        for t in extra_det:
            tree.add(t, -1, sampled=False)
        return tree
    return make


def _root_logits(p: torch.Tensor, n_nodes: int) -> torch.Tensor:
    other = torch.full((n_nodes, p.numel()), 0.0)  # rows of the drafted nodes: unused for the first token
    return torch.cat([_log(p)[None], other])


def test_single_sampled_token_is_speculative_sampling(chi2):
    counts = _first_tokens(verify, _sampled_children(Q8), _root_logits(P8, 1), SAMPLE, seed=1, k=1)
    stat, df, pval = chi2(counts, P8)
    assert pval > ALPHA, (stat, df, pval, counts.tolist())


@pytest.mark.parametrize("k", [2, 3])
def test_children_sampled_without_replacement(chi2, k):
    counts = _first_tokens(verify, _sampled_children(Q8), _root_logits(P8, k), SAMPLE, seed=2 + k, k=k)
    stat, df, pval = chi2(counts, P8)
    assert pval > ALPHA, (stat, df, pval, counts.tolist())


def test_all_of_a_small_draft_support_sampled(chi2):
    """k equals the draft's support: after rejecting every child q is empty; the residual decides."""
    q = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.3, 0.0, 0.2, 0.0])
    counts = _first_tokens(verify, _sampled_children(q), _root_logits(P8, 3), SAMPLE, seed=7, k=3, q=q)
    stat, df, pval = chi2(counts, P8)
    assert pval > ALPHA, (stat, df, pval, counts.tolist())


def test_draft_equal_to_target_accepts_everything():
    g = torch.Generator().manual_seed(0)
    for toks in _gumbel_top_k(P8, 1, 300, g).tolist():
        tree = _sampled_children(P8)(toks)
        v = verify(tree, _root_logits(P8, 1), SAMPLE, None, g)
        assert v.accepted == [0]


def _det_tree(det):
    tree = TokenTree()
    for t in det:
        tree.add(t, -1)
    return tree


def test_deterministic_children(chi2):
    """Model-free drafts (sampled=False): the token is drawn from p; the walk descends on a match."""
    det = [0, 5, 3]  # 3 has target probability 0
    counts = _first_tokens(verify, lambda toks: _det_tree(det), _root_logits(P8, len(det)), SAMPLE,
                           seed=11, k=0)
    stat, df, pval = chi2(counts, P8)
    assert pval > ALPHA, (stat, df, pval, counts.tolist())


def test_deterministic_child_match_descends():
    tree = _det_tree([0, 5])
    tree.add(2, 1)  # a grandchild under token 5
    p_root = torch.zeros(V8)
    p_root[5] = 1.0
    p5 = torch.zeros(V8)
    p5[2] = 1.0
    logits = torch.stack([_log(p_root), _log(P8), _log(p5), _log(P8)])
    v = verify(tree, logits, SAMPLE, None, torch.Generator().manual_seed(0))
    assert v.accepted == [1, 2] and v.tokens[:2] == [5, 2]


def test_mixed_sampled_and_deterministic_children(chi2):
    counts = _first_tokens(verify, _sampled_children(Q8, extra_det=[0, 6]), _root_logits(P8, 4), SAMPLE,
                           seed=13, k=2)
    stat, df, pval = chi2(counts, P8)
    assert pval > ALPHA, (stat, df, pval, counts.tolist())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1),
])
def test_processed_target_distribution(chi2, params):
    """With temperature / truncation the verifier targets target_probs(logits, params)."""
    logits = torch.tensor([[1.0, -0.5, 0.7, 0.2, 0.1, 1.2, -1.0, 0.3]])
    p = target_probs(logits, params)[0]
    q = target_probs(torch.tensor([[0.2, 0.8, -0.3, 0.5, 1.0, -2.0, 0.0, 0.4]]), params)[0]
    counts = _first_tokens(verify, _sampled_children(q), torch.cat([logits, torch.zeros(2, V8)]), params,
                           n=12_000, seed=18, k=min(2, int((q > 0).sum())), q=q)
    stat, df, pval = chi2(counts, p)
    assert pval > ALPHA, (stat, df, pval, counts.tolist())


# ---------------------------------------------------------------- depth 2

V6 = 6
P1 = torch.tensor([0.30, 0.05, 0.20, 0.15, 0.25, 0.05])
Q1 = torch.tensor([0.10, 0.30, 0.05, 0.25, 0.10, 0.20])
_g = torch.Generator().manual_seed(123)
P2 = torch.softmax(torch.randn(V6, V6, generator=_g) * 1.2, -1)  # p2(y | x) = P2[x, y]
Q2 = torch.softmax(torch.randn(V6, V6, generator=_g) * 1.2, -1)
P3 = torch.full((V6,), 1.0 / V6)


def _depth2_run(verify_fn, params, n, seed, history=None, det=True):
    """First two emitted tokens over ``n`` verifications of a two-level sampled tree.

    Root: 2 children drawn from Q1 without replacement; each child x gets 2 children
    drawn from Q2[x]; the first child also gets a deterministic child (x + 1) % V.
    Rows: root = log P1, node with token x = log P2[x], depth-2 nodes = uniform.
    When a step emits a single token x (no draft accepted), the second token is
    drawn from the target at x, as the next decoding step would.
    """
    g_draft = torch.Generator().manual_seed(20_000 + seed)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V6, V6)
    roots = _gumbel_top_k(Q1, 2, n, g_draft).tolist()
    kids = [_gumbel_top_k(Q2[x], 2, n, g_draft).tolist() for x in range(V6)]
    table = torch.cat([_log(P1)[None], _log(P2), _log(P3)[None]])  # row 0, rows 1 + x, row 1 + V
    second = _depth2_expected(params, history)
    second = second / second.sum(-1, keepdim=True)  # the target's p2(. | x) as the next step sees it
    for i, root_toks in enumerate(roots):
        tree = TokenTree()
        tree.q[-1] = Q1
        rows = [0]
        firsts = []
        for x in root_toks:
            firsts.append(tree.add(x, -1, sampled=True))
            rows.append(1 + x)
        for j, c in enumerate(firsts):
            x = tree.tokens[c]
            tree.q[c] = Q2[x]
            for y in kids[x][i]:
                tree.add(y, c, sampled=True)
                rows.append(1 + V6)
            if det and j == 0:
                tree.add((x + 1) % V6, c, sampled=False)
                rows.append(1 + V6)
        v = verify_fn(tree, table[rows], params, history, g)
        x = v.tokens[0]
        y = v.tokens[1] if len(v.tokens) >= 2 else int(torch.multinomial(second[x], 1, generator=g))
        counts[x, y] += 1
    return counts


def _depth2_expected(params, history=None):
    extra = params.repetition_penalty != 1.0
    h = history if extra else None
    p1 = target_probs(_log(P1)[None], params, h)[0]
    rows = [target_probs(_log(P2[x])[None], params, h, [[x]] if extra else None)[0] for x in range(V6)]
    return p1[:, None] * torch.stack(rows)


@pytest.mark.parametrize("params,history", [
    (SamplingParams(temperature=1.0), None),
    (SamplingParams(temperature=1.0, repetition_penalty=1.8), torch.tensor([2, 5])),
])
def test_depth2_joint_distribution(chi2, params, history):
    counts = _depth2_run(verify, params, 15_000, seed=31, history=history)
    expected = _depth2_expected(params, history)
    stat, df, pval = chi2(counts, expected)
    assert pval > ALPHA, (stat, df, pval)


# ---------------------------------------------------------------- planted errors


def _flawed_verify(flaw: str):
    """A copy of the verifier's sampling branch with one deliberate error."""

    def fn(tree, logits, params, history=None, generator=None):
        extra = None
        if params.repetition_penalty != 1.0:
            from leapdecode.core.verifier import _ancestor_tokens
            extra = _ancestor_tokens(tree)
        probs = target_probs(logits, params, history, extra)
        children = tree.child_map()
        node, path = -1, []
        while True:
            p = probs[node + 1]
            kids = children.get(node, [])
            sampled = [c for c in kids if tree.sampled[c]]
            descended = -1
            if sampled:
                q = tree.q[node].clone().float()
                for c in sampled:
                    x = tree.tokens[c]
                    qx, px = q[x].item(), p[x].item()
                    u = torch.rand((), generator=generator).item()
                    accept = (u * px < qx) if flaw == "q_over_p" else (u * qx < px)
                    if accept:
                        descended = c
                        break
                    if flaw != "no_residual":
                        residual = (p - q).clamp_min(0.0)
                        p = residual / residual.sum() if residual.sum() > 0 else p
                    if flaw != "no_q_update":
                        q[x] = 0.0
                        if q.sum() <= 0:
                            break
                        q = q / q.sum()
            if descended < 0:
                token = int(torch.multinomial(p, 1, generator=generator).item())
                descended = next((c for c in kids if not tree.sampled[c] and tree.tokens[c] == token), -1)
                if descended < 0:
                    return Verdict(path, token, [tree.tokens[c] for c in path] + [token])
            path.append(descended)
            node = descended

    return fn


def test_harness_accepts_the_unflawed_copy(chi2):
    """Sanity for the planted-error tests: the copy without a flaw passes like the real verifier."""
    counts = _first_tokens(_flawed_verify("none"), _sampled_children(Q8), _root_logits(P8, 3), SAMPLE,
                           seed=3, k=3)
    assert chi2(counts, P8)[2] > ALPHA


@pytest.mark.parametrize("flaw,k", [("q_over_p", 1), ("q_over_p", 3), ("no_residual", 1), ("no_q_update", 3)])
def test_planted_error_is_detected(chi2, flaw, k):
    """The same harness, seeds and N as the exactness tests must reject a wrong acceptance rule."""
    counts = _first_tokens(_flawed_verify(flaw), _sampled_children(Q8), _root_logits(P8, k), SAMPLE,
                           seed=2 + k, k=k)
    stat, df, pval = chi2(counts, P8)
    assert pval < ALPHA, f"{flaw}: chi-square did not reject (stat {stat:.1f}, df {df}, p {pval:.3g})"


def test_planted_error_is_detected_at_depth_2(chi2):
    counts = _depth2_run(_flawed_verify("q_over_p"), SAMPLE, 15_000, seed=31)
    stat, df, pval = chi2(counts, _depth2_expected(SAMPLE))
    assert pval < ALPHA, (stat, df, pval)


def test_chi2_helper_detects_a_two_percent_shift(chi2):
    """The power claim in the module docstring, checked empirically on exact multinomial draws."""
    g = torch.Generator().manual_seed(5)
    shifted = P8.clone()
    shifted[0] -= 0.02
    shifted[5] += 0.02
    rejections = 0
    for _ in range(20):
        counts = torch.bincount(torch.multinomial(shifted, N, replacement=True, generator=g), minlength=V8)
        rejections += chi2(counts, P8)[2] < ALPHA
    assert rejections >= 17  # predicted power ~0.99 (P8[0] = 0.22, P8[5] = 0.25: lambda = 41)
    false_alarms = 0
    for _ in range(20):
        counts = torch.bincount(torch.multinomial(P8, N, replacement=True, generator=g), minlength=V8)
        false_alarms += chi2(counts, P8)[2] < ALPHA
    assert false_alarms <= 2


def test_zero_probability_draft_token_is_an_error():
    tree = TokenTree()
    tree.add(5, -1, sampled=True)  # Q8[5] == 0: cannot have been drawn from Q8
    tree.q[-1] = Q8
    with pytest.raises(ValueError):
        verify(tree, _root_logits(P8, 1), SAMPLE, None, torch.Generator().manual_seed(0))


def test_allowed_mask_in_sampling():
    allowed = torch.zeros(2, V8, dtype=torch.bool)
    allowed[:, [1, 4]] = True
    g = torch.Generator().manual_seed(0)
    seen = set()
    for toks in _gumbel_top_k(Q8, 1, 300, g).tolist():
        v = verify(_sampled_children(Q8)(toks), _root_logits(P8, 1), SAMPLE, None, g, allowed=allowed)
        seen.add(v.tokens[0])
    assert seen == {1, 4}


# ===========================================================================
# sampling parameters == transformers' logits processors

import transformers.generation.logits_process as lp  # noqa: E402  (a dependency: no skip)


def _hf_probs(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor) -> torch.Tensor:
    scores = logits.clone()
    ids = history[None].expand(logits.shape[0], -1)
    if params.repetition_penalty != 1.0:
        scores = lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if params.temperature == 0:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
    procs = []
    if params.temperature != 1.0:
        procs.append(lp.TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        procs.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        procs.append(lp.MinPLogitsWarper(params.min_p))
    if params.typical_p < 1.0:
        procs.append(lp.TypicalLogitsWarper(params.typical_p))
    for proc in procs:
        scores = proc(ids, scores)
    return scores.softmax(-1)


@settings(max_examples=300, **HSET)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 64),
    temperature=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 4.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 70)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
    typical_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    penalty=st.one_of(st.just(1.0), st.floats(0.5, 2.0)),
    scale=st.sampled_from([0.5, 2.0, 8.0]),
)
def test_target_probs_match_transformers(seed, vocab, temperature, top_k, top_p, min_p, typical_p, penalty, scale):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=g) * scale
    history = torch.randint(0, vocab, (5,), generator=g)
    params = SamplingParams(temperature, top_k, top_p, min_p, typical_p, penalty)
    ours = target_probs(logits, params, history)
    ref = _hf_probs(logits, params, history)
    assert torch.allclose(ours.sum(-1), torch.ones(3), atol=1e-5)
    assert torch.equal(ours > 0, ref > 0), "different kept token sets"
    assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(top_k=-1), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_p=-0.2), dict(min_p=1.0), dict(min_p=-0.1), dict(typical_p=0.0), dict(typical_p=1.01),
    dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(temperature=math.nan), dict(repetition_penalty=math.nan)])
def test_nan_sampling_params_are_invalid(kwargs):
    """NaN passes ``x < 0`` / ``x <= 0`` checks; it must still be rejected, not crash or corrupt later."""
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------ the sampler itself
def test_sample_draws_from_the_distribution(chi2):
    """``sampling.sample`` (inverse transform, the verifier's draw) follows its weights, unnormalised
    ones too, and never draws a zero-weight index."""
    from leapdecode.core.sampling import sample

    g = torch.Generator().manual_seed(3)
    weights = torch.tensor([0.5, 0.0, 3.0, 1.5, 0.0, 2.0, 0.25, 0.75])
    draws = sample(weights, g, 40_000)
    assert draws.shape == (40_000,)
    counts = torch.bincount(draws, minlength=8)
    assert counts[1] == 0 and counts[4] == 0
    assert chi2(counts, weights / weights.sum())[2] > ALPHA
    # a planted error: the same draws against a distribution 5% off on two tokens are rejected
    shifted = weights.clone()
    shifted[2], shifted[5] = 3.15, 1.85
    assert chi2(counts, shifted / shifted.sum())[2] < ALPHA


def test_sample_rows_and_edges():
    from leapdecode.core.sampling import sample

    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    assert sample(rows, g, 50).tolist() == [[2] * 50, [0] * 50, [1] * 50]
    # a one-hot at the very end: rounding at the top of the cumulative sum never lands past it
    last = torch.zeros(50_000)
    last[-1] = 1e-30
    assert sample(last, g, 100).eq(49_999).all()
    first = torch.zeros(50_000)
    first[0] = 1.0
    assert sample(first, g, 100).eq(0).all()
    # the same generator state gives the same draws
    p = torch.rand(1000)
    a = sample(p, torch.Generator().manual_seed(7), 10)
    b = sample(p, torch.Generator().manual_seed(7), 10)
    assert torch.equal(a, b)
    for bad in (torch.zeros(4), torch.tensor([0.5, -0.1, 0.6]), torch.tensor([float("nan"), 1.0]), torch.zeros(0)):
        with pytest.raises(ValueError):
            sample(bad, g)


# ------------------------------------------------------------------ drafter-invariant sampling
def test_position_uniform_is_uniform_and_keyed_by_seed_and_position(chi2):
    """``position_uniform``: 20 equal bins over 40,000 (seed, position) pairs fit the uniform
    distribution; it is a function of (seed, position) only; neighbouring seeds and positions
    give unrelated numbers (no shared draws between the streams of seeds s and s + 1)."""
    from leapdecode.core.sampling import position_uniform

    us = torch.tensor([position_uniform(s, t) for s in range(40) for t in range(1000)], dtype=torch.float64)
    assert bool(((us >= 0) & (us < 1)).all())
    counts = torch.bincount((us * 20).long(), minlength=20)
    assert chi2(counts, torch.full((20,), 0.05))[2] > ALPHA
    # a planted error: the same numbers squeezed by 5% towards 0 are rejected
    assert chi2(torch.bincount((us * 0.95 * 20).long(), minlength=20), torch.full((20,), 0.05))[2] < ALPHA
    assert position_uniform(7, 3) == position_uniform(7, 3)
    a = [position_uniform(5, t) for t in range(200)]
    b = [position_uniform(6, t) for t in range(200)]
    assert not set(a) & set(b) and len(set(a)) == 200
    # consecutive pairs are not correlated (a lag-1 correlation of an independent stream is ~0)
    x = us.view(40, 1000)
    corr = torch.corrcoef(torch.stack([x[:, :-1].flatten(), x[:, 1:].flatten()]))[0, 1]
    assert abs(float(corr)) < 0.03


def test_sample_at_is_samples_rule():
    """``sample_at(p, u)`` is the index ``sample`` draws with the uniform number ``u``."""
    from leapdecode.core.sampling import sample, sample_at

    g = torch.Generator().manual_seed(11)
    p = torch.rand(300) * (torch.rand(300) > 0.5)
    for _ in range(50):
        state = g.get_state()
        want = int(sample(p, g)[0])
        g.set_state(state)
        u = float(torch.rand(1, 1, generator=g, dtype=torch.float64))
        assert sample_at(p, u) == want
    assert sample_at(torch.tensor([0.0, 1.0, 0.0]), 0.999999) == 1  # never a zero-weight index
    for bad_u in (-0.1, 1.0):
        with pytest.raises(ValueError):
            sample_at(p, bad_u)


def _invariant_case(g: torch.Generator):
    """A random two-level tree over V6 (sampled and deterministic nodes, duplicates allowed, the
    vanilla path planted under some nodes) for the toy target of the depth-2 tests."""
    tree = TokenTree()
    tree.q[-1] = Q1
    rows = [0]
    for _ in range(int(torch.randint(0, 4, (), generator=g))):
        x = int(torch.randint(0, V6, (), generator=g))
        c = tree.add(x, -1, sampled=bool(torch.rand((), generator=g) < 0.5))
        rows.append(1 + x)
        tree.q[c] = Q2[x]
        for _ in range(int(torch.randint(0, 3, (), generator=g))):
            tree.add(int(torch.randint(0, V6, (), generator=g)), c, sampled=bool(torch.rand((), generator=g) < 0.5))
            rows.append(1 + V6)
    return tree, rows


def _vanilla_chain(us: list[float], params) -> list[int]:
    """Vanilla sampling of the toy target, one position after another, with the positions' numbers."""
    from leapdecode.core.sampling import sample_at

    t0 = sample_at(target_probs(_log(P1)[None], params)[0], us[0])
    t1 = sample_at(target_probs(_log(P2[t0])[None], params)[0], us[1])
    t2 = sample_at(target_probs(_log(P3)[None], params)[0], us[2])
    return [t0, t1, t2]


def _invariance_mismatches(verify_fn, params, n=3000, seed=5) -> tuple[int, list[int]]:
    """Over ``n`` random trees: how many verdicts differ from vanilla's tokens for the same numbers,
    and how often 0, 1, 2 draft tokens were accepted."""
    from leapdecode.core.sampling import position_uniform

    g = torch.Generator().manual_seed(seed)
    table = torch.cat([_log(P1)[None], _log(P2), _log(P3)[None]])
    bad, accepted = 0, [0, 0, 0]
    for i in range(n):
        us = [position_uniform(i, t) for t in range(4)]  # one spare for the planted shift
        tree, rows = _invariant_case(g)
        want = _vanilla_chain(us, params)
        if i % 2 and len(tree):  # plant the vanilla path: its first token on the first root child
            tree.tokens[0] = want[0]
            if len(tree) > 1 and tree.parents[1] == 0:
                tree.tokens[1] = want[1]
            rows[1] = 1 + want[0]
            tree.q[0] = Q2[want[0]]
        v = verify_fn(tree, table[rows], params, uniform=us.__getitem__)
        accepted[len(v.accepted)] += 1
        bad += v.tokens != want[: len(v.tokens)] or any(tree.tokens[c] != t for c, t in zip(v.accepted, v.tokens))
    return bad, accepted


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_drafter_invariant_verdicts_are_vanillas_tokens(params):
    """With ``uniform``, every verdict (any tree: sampled or deterministic nodes, duplicates, the
    vanilla path planted or not) emits exactly vanilla's tokens for the same per-position numbers,
    and drafts are accepted at both depths."""
    bad, accepted = _invariance_mismatches(verify, params)
    assert bad == 0
    assert min(accepted) > 100, accepted


def test_drafter_invariance_test_catches_a_shifted_position():
    """A planted error: a verifier that draws depth d's token with the number of depth d + 1 (or
    draws the emitted token from the generator) is caught by the same harness."""
    def shifted(tree, logits, params, uniform):
        return verify(tree, logits, params, uniform=lambda d: uniform(d + 1))

    def from_generator(tree, logits, params, uniform):  # (the nodes as deterministic ones: no q needed)
        tree.sampled = [False] * len(tree)
        return verify(tree, logits, params, generator=torch.Generator().manual_seed(0))

    for flawed in (shifted, from_generator):
        bad, _ = _invariance_mismatches(flawed, SamplingParams(temperature=1.0), n=400)
        assert bad > 100, flawed.__name__
