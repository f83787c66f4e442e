"""Grammar-aligned sampling (ASAp, constraints/asap.py): successive samples approach the model's
distribution conditioned on the grammar, which plain grammar-constrained sampling (GCD) does not.

The language is small enough to enumerate, so both distributions are computed exactly from the
model's logits: the conditional P(w) / sum P(w') (w ending with EOS), and GCD's product of
renormalized masked next-token probabilities."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("llguidance")

from leapdecode.errors import InvalidParameterError  # noqa: E402
from leapdecode.constraints.asap import ASApSampler, Node  # noqa: E402

PROMPT = "hello"
# first letters whose continuations differ in how grammatical the model keeps them
REGEX = "(a[xyz][xyz]|b|c[xyz])"
LANGUAGE = ["b"] + ["c" + x for x in "xyz"] + ["a" + x + y for x, y in itertools.product("xyz", repeat=2)]


def _log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        cache = model.model.new_cache(max_len=64)
        return model.model.forward(torch.tensor([ids]), cache)[0].float().log_softmax(-1)


def exact_distributions(model) -> tuple[dict[str, float], dict[str, float]]:
    """(conditional, GCD) over LANGUAGE at temperature 1."""
    tok = model.tokenizer
    prompt = tok.encode(PROMPT)
    eos = sorted(model.eos_token_ids)
    joint, gcd = {}, {}
    for w in LANGUAGE:
        seq = tok.encode(w)
        lp = _log_probs(model, prompt + seq)
        rows = [lp[len(prompt) - 1 + i] for i in range(len(seq) + 1)]
        joint[w] = sum(rows[i][t].item() for i, t in enumerate(seq)) + torch.logsumexp(rows[-1][eos], 0).item()
        # GCD: at each prefix, renormalize over the tokens that keep the prefix in the language
        g = 0.0
        for i, t in enumerate(seq):
            prefix = w[:i]
            nxt = sorted({v[i] for v in LANGUAGE if v.startswith(prefix) and len(v) > i})
            allowed = [tok.encode(ch)[0] for ch in nxt]
            g += rows[i][t].item() - torch.logsumexp(rows[i][allowed], 0).item()
        gcd[w] = g  # at the end only EOS is allowed: probability 1
    z = torch.logsumexp(torch.tensor(list(joint.values())), 0).item()
    return ({w: math.exp(v - z) for w, v in joint.items()}, {w: math.exp(v) for w, v in gcd.items()})


def total_variation(p: dict[str, float], q: dict[str, float]) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def test_asap_approaches_the_conditional_distribution_where_gcd_does_not(tiny):
    model = tiny(seed=9)
    cond, gcd = exact_distributions(model)
    assert abs(sum(cond.values()) - 1) < 1e-6 and abs(sum(gcd.values()) - 1) < 1e-4
    gap = total_variation(cond, gcd)
    assert gap > 0.3, f"the planted case must distort GCD (TV {gap:.3f}) for the test to mean anything"
    sampler = ASApSampler(model, PROMPT, regex=REGEX, temperature=1.0, max_new_tokens=6)
    texts = [sampler.sample(seed=i).text for i in range(120)]
    assert set(texts) <= set(LANGUAGE)
    late = texts[60:]
    empirical = {w: late.count(w) / len(late) for w in set(late)}
    # GCD's own samples would sit at TV `gap` from the conditional; ASAp's late samples near it
    assert total_variation(empirical, cond) < gap / 2, (empirical, cond, gcd)
    # the estimate of P(grammatical) converges toward the exact mass from above
    assert 0 < sampler.efg <= 1


def test_first_sample_is_plain_constrained_sampling(tiny):
    """With an empty trie there is no bias: the first ASAp sample equals seeded GCD's."""
    from leapdecode import generate

    model = tiny(seed=9)
    for seed in range(5):
        s = ASApSampler(model, PROMPT, regex=REGEX, temperature=1.0, max_new_tokens=6)
        gcd = generate(model, PROMPT, regex=REGEX, temperature=1.0, seed=seed, max_new_tokens=6, method="vanilla")
        assert s.sample(seed=seed).tokens == gcd.tokens


def test_node_estimate_sums_positive_terms():
    root = Node(unexplored=1e-20)
    child = Node(unexplored=0.1)
    child.refresh()
    root.children[7] = (0.4, child)
    root.refresh()
    # explored: 0.4 * 0.1, plus the unexplored mass at the optimistic 1, without cancellation
    assert root.efg == pytest.approx(0.4 * 0.1 + 1e-20, rel=1e-12)
    assert Node(unexplored=3e-21).efg == 1.0 and (lambda n: (n.refresh(), n.efg)[1])(Node(unexplored=3e-21)) == 3e-21


def test_invalid_settings_are_refused(tiny):
    model = tiny(seed=9)
    with pytest.raises(InvalidParameterError):
        ASApSampler(model, PROMPT, regex=REGEX, temperature=0.0)
    with pytest.raises(InvalidParameterError):
        ASApSampler(model, PROMPT, temperature=1.0)  # no grammar
