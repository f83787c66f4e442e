"""A generation's prefill planner (issue 48 item 1): the prompt's way through the target.

The prompt but its last token (the first step's root) runs in chunks aligned to position 0
(``prefill_chunk``): the same chunks whatever else runs, so a chunk's keys and values are the same
bits wherever it is computed, and the runner's prefix cache (``core/prefix_cache.py``) can reuse
them exactly.  ``PrefillPlanner`` decides the next chunk to compute after taking every chunk the
prefix cache holds, and keeps what the generation computed, under the keys of the sequence's
``BlockTable`` (the runner's block manager, ``core/kv_blocks.py``: whole chunks, or 16-token blocks
of the prompt and, at the end, of the generated tokens too).  It commits nothing and runs nothing:
the generation runs the forward, commits it and tells the planner (``computed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .kv_policy import PREFILL_CHUNK as POLICY_PREFILL_CHUNK
from .kv_policy import KVPolicy
from .kv_blocks import BlockTable
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


class PrefillPlanner:
    """The prefill of ``prompt_ids`` into ``cache`` through ``runner``'s prefix cache (see the
    module docstring).  ``policy``: a KV-cache policy (its generation neither reads nor writes
    the prefix cache)."""

    def __init__(self, runner: "ModelRunner", cache: Any, prompt_ids: list[int], policy: KVPolicy | None = None, *,
                 decoder: Any = None, use_prefix: bool = True, restore: bool = True, scope: str | None = None) -> None:
        # ``decoder``: another model than the runner's target (contrastive decoding's amateur), with
        # ``use_prefix=False``; ``restore=False``: compute every chunk (a caller that wants every
        # prompt forward's hidden states), still keeping them in the prefix cache; ``scope``: the
        # request's memory scope (a server's tenant), whose blocks no other scope restores
        target = runner.model.model if decoder is None else decoder
        self.cache, self.ids, self.device = cache, prompt_ids, target.device
        self.restore = restore
        self.chunk = min(prefill_chunk(target, policy), cache.max_pending)
        self.prefilled = 0  # prompt tokens in the cache (computed or restored)
        self.reused = 0  # of which restored from the prefix cache
        # the sequence's keys in the runner's prefix cache (None: nothing restored or kept)
        self.blocks: BlockTable | None = runner.blocks.table(target, len(prompt_ids), self.chunk, policy,
                                                             scope=scope) if use_prefix else None

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

    @property
    def keeps_output(self) -> bool:
        """The generation keeps its output's blocks in the prefix cache at its end (``keep_decided``)."""
        return self.blocks is not None and self.blocks.keep_output

    def next_forward(self, features: int) -> Forward | None:
        """The next prompt chunk to compute, after taking every chunk the prefix cache has (None:
        the prefill is done).  ``features``: the proposer reads the hidden states of the prompt's
        last ``features`` tokens (the forwards that hold them ask for them)."""
        ids, cache, blocks, end = self.ids, self.cache, self.blocks, self.end
        if blocks is not None and blocks.in_blocks:
            if self.restore and self.prefilled == blocks.covered:  # (not after adopt)
                s = blocks.restore_blocks(cache, ids, end)
                self.reused += s - self.prefilled
                self.prefilled = s
            if self.prefilled >= end:
                return None
            s = self.prefilled
            stop = min(s + self.chunk, end)
            return Forward(torch.tensor(ids[s:stop], device=self.device),
                           hidden=[] if features > 0 and stop > end - features else None)
        while self.prefilled < end:
            s = self.prefilled
            chunk = ids[s : min(s + self.chunk, end)]
            key = blocks.chunk_key(chunk) if blocks is not None and len(chunk) == self.chunk else None
            if key is not None and self.restore and blocks.restore_chunk(key, cache, len(chunk)):
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
            self.blocks.keep_chunk(work.prefill_key, self.cache, self.prefilled, work.tokens.numel())
        elif self.blocks is not None and self.blocks.in_blocks:  # every whole block this forward computed
            self.blocks.keep_blocks(self.cache, self.ids, self.prefilled)

    def keep_decided(self, ids: list[int], upto: int) -> None:
        """At the generation's end: keep every whole block of ``ids`` (all the tokens decided) whose
        keys and values are committed below slot ``upto`` (a model keyed in blocks that prefills
        cut-invariantly computes a decoded token's keys and values with a prefill's bits)."""
        self.blocks.keep_blocks(self.cache, ids, upto)
