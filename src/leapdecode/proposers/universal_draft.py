"""Speculative decoding with a draft model whose tokenizer differs from the target's.

This is Universal Assisted Generation (UAG: "Universal Assisted Generation:
Faster Decoding with Any Assistant Model", Hugging Face blog, 2024; the
algorithm of ``AssistedCandidateGeneratorDifferentTokenizers`` in
``transformers/generation/candidate_generator.py``): the two models meet in
*text*.  The target's decided tokens are decoded to text and re-encoded with
the draft's tokenizer; the draft continues that text greedily; its new tokens
are decoded and encoded with the target's tokenizer, and the target tokens
that follow what is already decided become a linear draft (a deterministic
chain, ``sampled=False``).  The verifier then accepts exactly what the target
itself would emit, so greedy output is unchanged and sampling keeps the
target's distribution; a poor re-tokenization only costs speed.

Differences from the transformers implementation, for speed:

* **Incremental alignment.**  Rather than re-encoding a look-behind window and
  searching for the longest common diagonal, we keep the draft-side token
  sequence ``D`` (all committed in the draft's KV cache) and an *anchor*: a
  position in ``D`` at which ``D[:anchor]`` is trusted and the text after it
  (``tail``) is known.  Each step the newly decided target text is appended to
  ``tail``, only ``tail`` (a few tokens plus the new text) is re-encoded, the
  draft cache is truncated where the re-encoding departs from ``D`` and only
  the new draft tokens are fed.  The anchor then moves up to a few tokens
  before the end, so the re-encoded window stays short and merges across the
  window start (a word growing as text arrives) cannot happen in practice.
* **Drafted tokens are kept.**  The draft tokens forwarded while drafting are
  committed to the draft cache optimistically; the next re-encoding keeps the
  ones the target's text confirms and truncates the rest, so accepted draft
  tokens are never recomputed.
* **Boundary-safe conversion.**  Draft text is turned into target tokens by
  re-encoding the last few decided target tokens' text together with it and
  checking that the re-encoding reproduces those tokens (a merge across the
  boundary would otherwise shift everything); if it does not, the draft text
  is encoded on its own and used only if it decodes back to the same text.
* **Adaptive length.**  ``draft_len`` draft tokens per step (default 6), +1
  when the whole chain was accepted, -1 when it was rejected in its first
  half, within ``[min_draft_len, max_draft_len]`` (2..12).
* **Chat prompts.**  A prompt rendered with the target's chat template (one
  user message, optionally after a system message) is re-rendered with the
  *draft's* chat template, so the draft sees its own turn markers; other
  prompts are given to the draft as their text.
"""

from __future__ import annotations

import math
import time

import torch

from ..core.tree import TokenTree
from ..core.proposer import DecodeContext, Proposer, feed_committed
from .configs import DraftConfig

_SENTINELS = ("\x00leapdecode-system\x00", "\x00leapdecode-user\x00")


class _Tok:
    """Fast paths around a transformers tokenizer: no special tokens, no clean-up."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        # control tokens (decoded as nothing): the declared special ids and added tokens marked special
        self.special = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
        try:
            added = tokenizer.added_tokens_decoder.items()
        except Exception:
            added = ()
        self.special.update(int(i) for i, t in added if getattr(t, "special", False))

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=False).ids
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def text_after(self, ctx: list[int], ids: list[int]) -> str | None:
        """The text ``ids`` add after ``ctx``: decoding with context keeps the leading
        spaces that some decoders strip from a sequence's first token."""
        if not ids:
            return ""
        pre = self.decode(ctx) if ctx else ""
        full = self.decode(ctx + ids)
        if full.startswith(pre):
            return full[len(pre):]
        return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def chat_messages(tokenizer, prompt_ids: list[int]) -> list[dict] | None:
    """The messages whose chat-template rendering (with the generation prompt) is exactly
    ``prompt_ids``: one user message, or a system and a user message; else ``None``."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except Exception:
        return None
    markers = set(getattr(tokenizer, "all_special_tokens", None) or [])
    try:
        markers |= set(tokenizer.get_added_vocab())
    except Exception:
        pass
    markers.discard("")
    shapes = [[("user", _SENTINELS[1])], [("system", _SENTINELS[0]), ("user", _SENTINELS[1])]]
    for shape in shapes:
        try:
            rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in shape],
                                                     add_generation_prompt=True, tokenize=False)
        except Exception:
            continue
        # split the rendering at the sentinels: literal pieces around the contents
        pieces, rest = [], rendered
        for _, sentinel in shape:
            if rest.count(sentinel) != 1:
                break
            before, rest = rest.split(sentinel)
            pieces.append(before)
        else:
            pieces.append(rest)
            contents, pos = [], 0
            ok = text.startswith(pieces[0])
            pos = len(pieces[0])
            for i in range(1, len(pieces)):
                if not ok:
                    break
                nxt = pieces[i]
                if i == len(pieces) - 1:
                    end = len(text) - len(nxt) if nxt else len(text)
                    ok = text.endswith(nxt) and end >= pos
                else:
                    end = text.find(nxt, pos) if nxt else -1
                    ok = end >= 0
                if ok:
                    contents.append(text[pos:end])
                    pos = end + len(nxt)
            if not ok:
                continue
            if any(m in c for c in contents for m in markers):
                continue  # a content holding a control token: more turns than this shape
            messages = [{"role": r, "content": c} for (r, _), c in zip(shape, contents)]
            try:
                if _chat_ids(tokenizer, messages) == list(prompt_ids):
                    return messages
            except Exception:
                continue
    return None


class UniversalDraftProposer(Proposer):
    name = "draft"

    def __init__(
        self,
        draft,  # LoadedModel with a tokenizer other than the target's
        tree_budget: int | None = None,
        draft_len: int = DraftConfig.draft_len,
        min_draft_len: int = DraftConfig.min_draft_len,
        max_draft_len: int = DraftConfig.max_draft_len,
        adaptive: bool = DraftConfig.adaptive,
        window: int = DraftConfig.window,
        anchor_lag: int = DraftConfig.anchor_lag,
    ) -> None:
        if not 1 <= min_draft_len <= max_draft_len:
            raise ValueError("need 1 <= min_draft_len <= max_draft_len")
        if window < 1 or anchor_lag < 1:
            raise ValueError("window and anchor_lag must be >= 1")
        self.draft = draft
        self.default_budget = tree_budget or DraftConfig.other_tokenizer_tree_budget
        self.min_len, self.max_len = min_draft_len, max_draft_len
        self.draft_len = min(max(draft_len, min_draft_len), max_draft_len)
        self.adaptive = adaptive
        self.window = window  # target tokens re-encoded with the draft text
        self.anchor_lag = anchor_lag  # draft tokens re-encoded behind the newest text
        self.dtok = _Tok(draft.tokenizer)
        self.cache = None
        self._draft_forwards = 0
        self._proposed = 0
        self._empty = 0
        self._time = 0.0

    # ---------------------------------------------------------------- setup
    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.ttok = _Tok(ctx.target.tokenizer)
        self.vocab = min(self.draft.model.vocab_size, len(self.draft.tokenizer))
        self.disabled = False
        self.fed: list[int] = []  # draft tokens forwarded (pending) while drafting this step
        self.n_settled = len(tokens)  # target tokens whose text is in the draft-side text
        messages = chat_messages(ctx.target.tokenizer, tokens)
        head: list[int] | None = None
        if messages is not None and getattr(self.draft.tokenizer, "chat_template", None):
            try:
                head = _chat_ids(self.draft.tokenizer, messages)
            except Exception:
                head = None
        if head is not None:
            self.tail = ""
            self.floor = len(tokens)  # target tokens before this are template, not text
        else:
            self.tail = self.ttok.decode(tokens)
            bos = getattr(self.draft.tokenizer, "bos_token_id", None)
            head = [bos] if bos is not None and self.draft.tokenizer("a")["input_ids"][:1] == [bos] else []
            self.floor = 0
        # draft tokens per target token, to size the draft cache
        sample = self.tail or self.ttok.decode(tokens)
        t_len = max(len(self.ttok.encode(sample)), 1)
        ratio = min(max(len(self.dtok.encode(sample)) / t_len, 1.0), 8.0) if sample else 2.0
        needed = len(head) + len(self.dtok.encode(self.tail)) + math.ceil(ratio * ctx.max_new_tokens) + 64
        needed = min(self.draft.max_seq_len, needed + self.max_len + 64)
        self.cache = cache = ctx.acquire_cache(self.draft, needed)
        self.D: list[int] = []  # draft tokens committed in the draft cache
        if len(head) + 1 > cache.max_len:
            self.disabled = True
            return
        if head:
            self._feed(head, want_logits=False)
        self.anchor = len(self.D)  # D[:anchor] is trusted; `tail` is the text after it
        self._sync("", want_logits=False)

    # -------------------------------------------------------------- helpers
    def _feed(self, new: list[int], want_logits: bool = True) -> torch.Tensor | None:
        logits, forwards = feed_committed(self.draft, self.cache, new, want_logits)
        self._draft_forwards += forwards
        if logits is not None:
            logits = logits[: self.vocab]
        self.D.extend(new)
        return logits

    def _settle(self, tokens: list[int]) -> str:
        """Text of the target tokens decided since the last step.  Tokens that end inside a
        multi-byte character stay unsettled (at most three) until the character completes."""
        start, n = self.n_settled, len(tokens)
        if n <= start:
            return ""
        ctx = tokens[max(0, start - 4) : start]
        for end in range(n, max(start, n - 3), -1):
            text = self.ttok.text_after(ctx, tokens[start:end])
            if text is not None and not text.endswith("\ufffd"):
                break
        else:
            end = n
            text = self.ttok.text_after(ctx, tokens[start:n])
            if text is None:
                text = self.ttok.decode(tokens[start:n])
        self.n_settled = end
        return text

    def _sync(self, new_text: str, want_logits: bool = True) -> torch.Tensor | None:
        """Bring the draft cache to the draft tokenization of the text so far; the draft's
        next-token logits (``None`` if there is nothing to condition on or no room)."""
        self.tail += new_text
        enc = self.dtok.encode(self.tail)
        m = _common_prefix(self.D[self.anchor :], enc)
        keep = self.anchor + m
        new = enc[m:]
        if not new and want_logits:
            if keep == 0:
                return None
            keep -= 1  # re-run the last token for its logits
            new = [self.D[keep]]
        if keep < len(self.D):
            self.cache.truncate(keep)
            del self.D[keep:]
        if len(new) > self.cache.room() - 1:
            self.disabled = True  # the draft text outgrew the draft's cache
            return None
        logits = self._feed(new, want_logits) if new else None
        # move the anchor to a few tokens before the end (D[anchor:] == enc now)
        j = len(enc) - self.anchor_lag
        if j > 0:
            ctx = self.D[max(0, self.anchor - 4) : self.anchor]
            text = self.dtok.text_after(ctx, enc[:j])
            if text and (self.tail.startswith(text) or len(self.tail) > 4096):
                self.anchor += j
                self.tail = self.tail[len(text):]
        return logits

    def _to_target(self, tokens: list[int], text: str) -> list[int]:
        """Target tokens continuing ``tokens`` with ``text``."""
        n = len(tokens)
        start = max(self.floor, n - self.window)
        for i in range(n - 1, start - 1, -1):
            if tokens[i] in self.ttok.special:
                start = i + 1
                break
        win = tokens[start:n]
        wtext = self.ttok.text_after(tokens[max(0, start - 4) : start], win)
        if wtext is not None:
            enc = self.ttok.encode(wtext + text)
            if enc[: len(win)] == win:
                return enc[len(win):]
        # the text merges with the decided tokens: try it on its own, if it reads the same
        alone = self.ttok.encode(text)
        if alone and self.ttok.text_after(tokens[max(start, n - 4) : n], alone) == text:
            return alone
        return []

    # -------------------------------------------------------------- propose
    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        t0 = time.perf_counter()
        try:
            return self._propose(tokens, budget)
        finally:
            self._time += time.perf_counter() - t0

    def _propose(self, tokens: list[int], budget: int) -> TokenTree:
        self.fed = []
        if self.cache.n_pending:
            self.cache.rollback()
        if self.disabled or budget < 1:
            return TokenTree()
        logits = self._sync(self._settle(tokens))
        if logits is None or self.n_settled < len(tokens):
            self._empty += 1
            return TokenTree()  # nothing to condition on, or the last character is incomplete
        k = min(self.draft_len, budget, self.cache.room())
        drafted: list[int] = []
        for i in range(k):
            x = int(torch.argmax(logits).item())
            if x in self.dtok.special:
                break  # end of turn / text: its text is empty
            drafted.append(x)
            if i == k - 1:
                break
            out = self.draft.model.forward(torch.tensor([[x]], device=self.draft.device), self.cache)
            self._draft_forwards += 1
            self.fed.append(x)
            logits = out[0, -1, : self.vocab]
        text = self.dtok.text_after(self.D[-4:], drafted) if drafted else ""
        text = (text or "").rstrip("\ufffd")
        new = self._to_target(tokens, text) if text else []
        if not new:
            self._empty += 1
            return TokenTree()
        new = new[:budget]
        self._proposed += len(new)
        return TokenTree.chain(new, source="draft")

    # -------------------------------------------------------------- observe
    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        # keep what the draft forwarded: the next re-encoding truncates what the text disowns
        if self.cache.n_pending:
            self.cache.commit()
            self.D.extend(self.fed)
        self.fed = []
        if self.adaptive and len(tree):
            accepted = len(verdict.accepted)
            if accepted >= len(tree):
                self.draft_len = min(self.draft_len + 1, self.max_len)
            elif 2 * accepted < len(tree):
                self.draft_len = max(self.draft_len - 1, self.min_len)

    def end(self) -> None:
        if self.cache is not None:
            self.cache.rollback()
        self.fed = []

    def stats(self) -> dict:
        return {"draft_forwards": self._draft_forwards, "draft_len": self.draft_len,
                "draft_proposed": self._proposed, "draft_empty_steps": self._empty,
                "draft_time_s": round(self._time, 4)}
