"""Exactness checks shared by tests/test_quant.py, test_invariant_attention.py and test_default_exact.py:
the prompts on which stock attention flips greedy tokens, and where speculative methods depart from
vanilla's greedy tokens."""

from __future__ import annotations

import leapdecode

PROMPTS = ["the cat sat on the mat. the cat sat on the", "abcabcabcabc", "Hello, world! Hello",
           "1 2 3 4 1 2 3 4 1 2", "to be or not to be, that is", "aaaa bbbb aaaa bbbb"]


def divergences(lm, prompts, methods, options=None) -> list:
    """(method, prompt, first differing token) wherever one of ``methods`` departs from vanilla's 40 greedy
    tokens."""
    out = []
    for prompt in prompts:
        vanilla = leapdecode.generate(lm, prompt, max_new_tokens=40, method="vanilla")
        assert 0 < len(vanilla.tokens) <= 40
        for method in methods:
            got = leapdecode.generate(lm, prompt, max_new_tokens=40, method=method,
                                      **({"options": options} if options else {}))
            if got.tokens != vanilla.tokens:
                first = next((i for i, (a, b) in enumerate(zip(got.tokens, vanilla.tokens)) if a != b),
                             min(len(got.tokens), len(vanilla.tokens)))
                out.append((method, prompt, first))
    return out
