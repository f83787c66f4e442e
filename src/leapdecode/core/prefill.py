"""A generation's prefill planner (issue 48 item 1): the prompt's way through the target.

The prompt but its last token (the first step's root) runs in chunks aligned to position 0
(``prefill_chunk``): the same chunks whatever else runs, so a chunk's keys and values are the same
bits wherever it is computed, and the runner's prefix cache (``core/prefix_cache.py``) can reuse
them exactly.  ``PrefillPlanner`` decides the next chunk to compute after taking every chunk the
prefix cache holds, and keeps what the generation computed: whole chunks keyed by their prefix, or,
on a model that prefills cut-invariantly (``keyed_in_blocks``), 16-token blocks of the prompt and,
at the end, of the generated tokens too (a decoding step computes a token's keys and values with a
prefill's bits there).  It commits nothing and runs nothing: the generation runs the forward,
commits it and tells the planner (``computed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .kv_policy import PREFILL_CHUNK as POLICY_PREFILL_CHUNK
from .kv_policy import KVPolicy
from .prefix_cache import PrefixCache
from .task import Forward

if TYPE_CHECKING:
    from .runner import ModelRunner

PREFILL_CHUNK = 256  # prompt tokens per prefill forward (and per prefix-cache entry), but see prefill_chunk


def prefill_chunk(decoder: Any, policy: KVPolicy | None = None) -> int:
    """Prompt tokens per prefill forward: with a KV policy, the policy's chunk; on a model that
    prefills cut-invariantly (``NativeCausalLM.prefill_cut_invariant``), its ``cut_invariant_tokens``
    (every token's keys and values then depend on the tokens up to it only); else ``PREFILL_CHUNK``,
    in chunks aligned to position 0.  Everything that prefills a prompt whose output must equal a
    ``Generation``'s (search strategies, teacher-forced passes) cuts it so."""
    if policy is not None:
        return POLICY_PREFILL_CHUNK
    if getattr(decoder, "prefill_cut_invariant", False):
        return decoder.cut_invariant_tokens
    return PREFILL_CHUNK


def keyed_in_blocks(decoder: Any, prefix: PrefixCache, prompt_len: int, chunk: int) -> bool:
    """Whether a prompt of ``prompt_len`` tokens (all but the last prefilled, in forwards of
    ``chunk``) is keyed in the prefix cache's ``BLOCK``-token blocks: where every prompt forward is
    at most ``cut_invariant_tokens`` long (a short prompt, or any prompt on a model that prefills
    cut-invariantly), a token's keys and values have the same bits however the prompt is cut."""
    cut = getattr(decoder, "cut_invariant_tokens", 0)
    end = prompt_len - 1
    return prefix.enabled and end > 0 and (end <= min(cut, chunk) or chunk <= cut)


class PrefillPlanner:
    """The prefill of ``prompt_ids`` into ``cache`` through ``runner``'s prefix cache (see the
    module docstring).  ``policy``: a KV-cache policy (its generation neither reads nor writes
    the prefix cache)."""

    def __init__(self, runner: "ModelRunner", cache: Any, prompt_ids: list[int], policy: KVPolicy | None = None, *,
                 decoder: Any = None, use_prefix: bool = True, restore: bool = True) -> None:
        # ``decoder``: another model than the runner's target (contrastive decoding's amateur), with
        # ``use_prefix=False``; ``restore=False``: compute every chunk (a caller that wants every
        # prompt forward's hidden states), still keeping them in the prefix cache
        target = runner.model.model if decoder is None else decoder
        self.runner, self.cache, self.ids, self.device = runner, cache, prompt_ids, target.device
        self.prefix = runner.prefix_cache if use_prefix else None
        self.restore = restore
        self.chunk = min(prefill_chunk(target, policy), cache.max_pending)
        self.prefilled = 0  # prompt tokens in the cache (computed or restored)
        self.reused = 0  # of which restored from the prefix cache
        self.key = b""  # the prefix cache's key of the prompt up to ``prefilled`` (or the last block kept)
        self.blocked = 0  # tokens covered by blocks restored from or stored in the prefix cache
        self.policy = policy
        self.fine = policy is None and self.prefix is not None and keyed_in_blocks(target, self.prefix, len(prompt_ids),
                                                                                  self.chunk)
        # the generated tokens' blocks are kept too at the end (see the module docstring)
        self.keep_output = self.fine and self.chunk <= getattr(target, "cut_invariant_tokens", 0)

    @property
    def end(self) -> int:
        """Prompt tokens the prefill covers: all but the last."""
        return len(self.ids) - 1

    @property
    def done(self) -> bool:
        return self.prefilled >= self.end

    def adopt(self, n: int) -> None:
        """``n`` prompt tokens' keys and values were copied in from another generation's prefill."""
        self.prefilled = self.reused = n

    def next_tokens(self) -> int:
        """About how many prompt tokens the next forward computes (blocks to restore not looked up)."""
        return max(min(self.end - self.prefilled, self.chunk), 0)

    def next_forward(self, features: int) -> Forward | None:
        """The next prompt chunk to compute, after taking every chunk the prefix cache has (None:
        the prefill is done).  ``features``: the proposer reads the hidden states of the prompt's
        last ``features`` tokens (the forwards that hold them ask for them)."""
        ids, cache, prefix, end = self.ids, self.cache, self.prefix, self.end
        if self.fine:
            if self.restore and self.prefilled == self.blocked:  # (not after adopt)
                self.key, s = prefix.restore_blocks(cache, ids, self.key, self.prefilled, end)
                self.reused += s - self.prefilled
                self.prefilled = self.blocked = s
            if self.prefilled >= end:
                return None
            s = self.prefilled
            stop = min(s + self.chunk, end)
            return Forward(torch.tensor(ids[s:stop], device=self.device),
                           hidden=[] if features > 0 and stop > end - features else None)
        while self.prefilled < end:
            s = self.prefilled
            chunk = ids[s : min(s + self.chunk, end)]
            whole = prefix is not None and len(chunk) == self.chunk and self.policy is None
            key = prefix.key(self.key, chunk) if whole else None
            if key is not None and self.restore and prefix.restore(key, cache):
                self.key = key
                self.prefilled += len(chunk)
                self.reused += len(chunk)
                continue
            hidden = [] if features > 0 and s + len(chunk) > end - features else None
            return Forward(torch.tensor(chunk, device=self.device), prefill_key=key, hidden=hidden)
        return None

    def computed(self, work: Forward) -> None:
        """``work``'s chunk is committed to the cache: count it, and keep it in the prefix cache."""
        self.prefilled += work.tokens.numel()
        if work.prefill_key is not None:
            self.key = work.prefill_key
            self.prefix.store(work.prefill_key, self.cache, self.prefilled, work.tokens.numel())
        elif self.fine:  # every whole block this forward computed
            self.keep_blocks(self.ids, self.prefilled)

    def keep_blocks(self, ids: list[int], upto: int) -> None:
        """Store in the prefix cache every whole block of ``ids`` (the prompt, or all the tokens
        decided so far) whose keys and values are committed below slot ``upto``."""
        self.key, self.blocked = self.prefix.store_blocks(self.cache, ids, self.key, self.blocked, upto)
