"""What a proposer is: a leaf that proposes a token tree and learns from the verdict.

Proposers never decide what is emitted; the verifier does.  Any proposer is
therefore lossless through the verifier, and a buggy proposer can only make
decoding slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..core.sampling import SamplingParams
from ..core.tree import TokenTree

if TYPE_CHECKING:
    from ..core.verifier import Verdict
    from ..models.kv_cache import KVCache
    from ..models.loader import LoadedModel


@dataclass
class DecodeContext:
    """What a proposer may look at during one generation."""

    target: "LoadedModel"
    cache: "KVCache"  # the target's cache (self-speculation shares it)
    params: SamplingParams
    generator: torch.Generator
    prompt_len: int
    max_new_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


def feed_committed(model, cache: "KVCache", new: list[int], want_logits: bool = True,
                   chunk: int = 512, head=None) -> tuple[torch.Tensor | None, int]:
    """Run ``new`` tokens through ``model`` (a ``LoadedModel``) and commit them to ``cache``,
    in chunks that fit the cache's pending area.  Returns (logits of the last token or None,
    number of forwards).  ``head``: see ``NativeCausalLM.forward``."""
    step = min(chunk, cache.max_pending)  # a chunk is pending until committed
    logits, forwards = None, 0
    for s in range(0, len(new), step):
        last = s + step >= len(new)
        ids = torch.tensor(new[s : s + step], device=model.device)[None]
        out = model.model.forward(ids, cache, logits_for=slice(-1, None) if (last and want_logits) else slice(0, 0),
                                  head=head)
        cache.commit()
        forwards += 1
        if last and want_logits:
            logits = out[0, -1]
    return logits, forwards


class Proposer:
    """Base class; subclasses implement ``propose`` and may override the hooks."""

    name = "base"

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        """A generation starts; ``tokens`` is the prompt (its last token is the root)."""
        self.ctx = ctx

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        """Draft continuations of ``tokens`` (whose last token is the root), at most ``budget`` nodes."""
        raise NotImplementedError

    def observe(self, tokens: list[int], tree: TokenTree, verdict: "Verdict", logits: torch.Tensor) -> None:
        """After verification: ``tokens`` now includes the emitted tokens; ``logits`` are the target's
        (row 0 = root, row i + 1 = node i)."""

    def end(self) -> None:
        """The generation finished (or was cancelled)."""

    def stats(self) -> dict[str, Any]:
        return {}
