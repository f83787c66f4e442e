"""The generation loop: propose -> verify -> commit -> update the proposer.

It is the same loop for every method.  Vanilla decoding is the case where the
proposer proposes nothing, so every step verifies just the root and emits the
target's next token.  End-of-sequence, stop strings and the token limit act on
committed tokens only.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..errors import InvalidParameterError, PromptTooLongError
from .sampling import SamplingParams
from .tree import TokenTree
from .verifier import verify

PREFILL_CHUNK = 512
TREE_MARGIN = 128  # cache slots reserved beyond the output for the last step's tree


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled"
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "stats": self.stats}


def encode_prompt(model, prompt, chat: bool | None = None) -> list[int]:
    """A string (plain, or as one user message with ``chat=True``) or a list of chat messages."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        else:
            ids = tok.encode(prompt)
            if not ids:
                raise InvalidParameterError("the prompt is empty")
            return ids
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise InvalidParameterError("prompt must be a string or a list of {'role', 'content'} messages")
    if not prompt:
        raise InvalidParameterError("the message list is empty")
    if not getattr(tok, "chat_template", None):
        raise InvalidParameterError(f"model {model.name} has no chat template; pass a plain string prompt")
    out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


class Generation:
    """One generation; iterate for text pieces as they are decided, then read ``.result``."""

    def __init__(
        self,
        model,
        prompt,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        typical_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        method: str = "auto",
        draft: str | None = None,
        tree_budget: int | None = None,
        chat: bool | None = None,
        prompt_ids: list[int] | None = None,
        **method_options: Any,
    ) -> None:
        from ..proposers import make_proposer

        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidParameterError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
        self.params = SamplingParams(temperature, top_k, top_p, min_p, typical_p, repetition_penalty, seed)
        if tree_budget is not None and (not isinstance(tree_budget, int) or tree_budget < 1):
            raise InvalidParameterError(f"tree_budget must be an integer >= 1, got {tree_budget}")
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameterError("stop strings must be non-empty strings")
        self.prompt_ids = list(prompt_ids) if prompt_ids is not None else encode_prompt(model, prompt, chat)
        if len(self.prompt_ids) + 1 > model.max_seq_len:
            raise PromptTooLongError(
                f"prompt has {len(self.prompt_ids)} tokens; the context of {model.name} holds "
                f"{model.max_seq_len} (prompt + at least 1 new token)"
            )
        self.method = method
        self.proposer = make_proposer(method, model, draft=draft, tree_budget=tree_budget, params=self.params,
                                      **method_options)
        self.tree_budget = tree_budget or getattr(self.proposer, "default_budget", 0)
        self.result: GenerationResult | None = None
        self._cancelled = False

    def cancel(self) -> None:
        """Stop at the next step (e.g. the client went away)."""
        self._cancelled = True

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    # ------------------------------------------------------------------ loop
    def _cache(self, needed: int):
        target = self.model.model
        cache = getattr(self.model, "_cache", None)
        if cache is None or cache.max_len < needed or cache.batch_size != 1:
            self.model._cache = cache = None  # free the old one before allocating
            cache = target.new_cache(batch_size=1, max_len=needed)
            self.model._cache = cache
        cache.reset()
        return cache

    def __iter__(self) -> Iterator[str]:
        from ..proposers.base import DecodeContext

        model, target, params = self.model, self.model.model, self.params
        tok = model.tokenizer
        t_start = time.perf_counter()
        device = target.device
        gen = torch.Generator(device=device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        ids = self.prompt_ids
        cache = self._cache(min(model.max_seq_len, len(ids) + self.max_new_tokens + TREE_MARGIN))
        step = min(PREFILL_CHUNK, cache.max_pending)  # a chunk is pending until committed
        for s in range(0, len(ids) - 1, step):
            chunk = torch.tensor(ids[s : min(s + step, len(ids) - 1)], device=device)
            target.forward(chunk[None], cache, logits_for=slice(0, 0))
            cache.commit()
        prefill_s = time.perf_counter() - t_start

        tokens = list(ids)  # decided so far; the last one is the root (not yet in the cache)
        generated: list[int] = []
        proposer = self.proposer
        ctx = DecodeContext(model, cache, params, gen, len(ids), self.max_new_tokens)
        if proposer is not None:
            proposer.begin(ctx, tokens)
        hist: Counter[int] = Counter()
        draft_s = verify_s = 0.0
        forwards = 0
        finish = None
        text, shown = "", 0
        history = torch.tensor(tokens, device=device) if params.repetition_penalty != 1.0 else None
        try:
            while finish is None:
                if self._cancelled:
                    finish = "cancelled"
                    break
                if cache.room() < 1:
                    finish = "length"
                    break
                remaining = self.max_new_tokens - len(generated)
                budget = min(self.tree_budget, cache.room() - 1, max(remaining - 1, 0))
                t0 = time.perf_counter()
                tree = proposer.propose(tokens, budget) if proposer is not None and budget > 0 else TokenTree()
                tree = tree.truncated(max(budget, 0))
                t1 = time.perf_counter()
                chain = all(p == i - 1 for i, p in enumerate(tree.parents))
                flat = torch.tensor([tokens[-1]] + tree.tokens, device=device)
                logits = target.forward(flat[None], cache, parents=None if chain else tree.flattened_parents())[0]
                verdict = verify(tree, logits, params, history, gen)
                cache.commit([0] + [a + 1 for a in verdict.accepted])
                verify_s += time.perf_counter() - t1
                draft_s += t1 - t0
                forwards += 1
                emitted = verdict.tokens
                hist[len(verdict.accepted)] += 1
                kept = []
                for t in emitted:
                    if t in model.eos_token_ids:
                        finish = "stop"
                        break
                    kept.append(t)
                    if len(generated) + len(kept) >= self.max_new_tokens:
                        finish = "length"
                        break
                generated.extend(kept)
                tokens.extend(emitted)
                if history is not None:
                    history = torch.tensor(tokens, device=device)
                if proposer is not None and finish is None:
                    t2 = time.perf_counter()
                    proposer.observe(tokens, tree, verdict, logits)
                    draft_s += time.perf_counter() - t2
                text = tok.decode(generated, skip_special_tokens=True)
                if self.stop:
                    cut = self._find_stop(text, shown)
                    if cut is not None:
                        text = text[:cut]
                        generated = self._tokens_covering(generated, cut)
                        finish = "stop"
                safe = len(text) if finish else self._safe_length(text)
                if safe > shown:
                    yield text[shown:safe]
                    shown = safe
        finally:
            if proposer is not None:
                proposer.end()
        wall = time.perf_counter() - t_start
        n = len(generated)
        stats: dict[str, Any] = {
            "method": self.method,
            "new_tokens": n,
            "prompt_tokens": len(ids),
            "target_forwards": forwards,
            "mean_accepted": round(n / forwards, 4) if forwards else 0.0,
            "accept_hist": {str(k): hist[k] for k in sorted(hist)},
            "wall_s": round(wall, 4),
            "prefill_s": round(prefill_s, 4),
            "draft_s": round(draft_s, 4),
            "verify_s": round(verify_s, 4),
            "tokens_per_s": round(n / wall, 3) if wall > 0 else 0.0,
        }
        if proposer is not None:
            stats.update(proposer.stats())
        self.result = GenerationResult(text, generated, len(ids), finish or "length", stats)

    # ------------------------------------------------------------ stop strings
    def _find_stop(self, text: str, since: int) -> int | None:
        cuts = []
        for s in self.stop:
            i = text.find(s, max(0, since - len(s)))
            if i >= 0:
                cuts.append(i)
        return min(cuts) if cuts else None

    def _tokens_covering(self, generated: list[int], n_chars: int) -> list[int]:
        """The shortest prefix of ``generated`` whose text reaches ``n_chars`` characters."""
        tok = self.model.tokenizer
        for k in range(len(generated) + 1):
            if len(tok.decode(generated[:k], skip_special_tokens=True)) >= n_chars:
                return generated[:k]
        return generated

    def _safe_length(self, text: str) -> int:
        """How much of ``text`` can be shown: not a half-decoded character, not a possible stop prefix."""
        n = len(text)
        while n and text[n - 1] == "\ufffd":
            n -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, n), 0, -1):
                if text[n - k : n] == s[:k]:
                    n -= k
                    break
        return n


def generate(model, prompt, **kwargs) -> GenerationResult:
    """Generate a continuation; see ``Generation`` for the parameters."""
    return Generation(model, prompt, **kwargs).run()


def stream(model, prompt, **kwargs) -> Generation:
    """Like ``generate`` but iterate for text pieces; ``.result`` is set at the end."""
    return Generation(model, prompt, **kwargs)
