"""Proposers: one file per drafting method.  ``make_proposer`` maps a method name to one."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidParameterError
from .base import DecodeContext, Proposer

METHODS = ["vanilla", "draft"]


def _load_draft(target, draft: str | None):
    """A draft ``LoadedModel``: the given name/path, else the target's registered pair."""
    from ..models.loader import LoadedModel, load

    if isinstance(draft, LoadedModel):
        return draft
    name = draft or target.draft_name
    if name is None:
        raise InvalidParameterError(
            f"method 'draft' needs a draft model: {target.name} has no registered draft; pass --draft NAME"
        )
    cache = target.__dict__.setdefault("_drafts", {})
    if name not in cache:
        cache[name] = load(name, dtype=target.dtype, device=target.device, backend="auto")
    return cache[name]


def make_proposer(method: str, target, draft=None, tree_budget: int | None = None, params=None,
                  **options: Any) -> Proposer | None:
    if method == "vanilla":
        return None
    if method == "draft":
        from .draft_model import DraftModelProposer

        dm = _load_draft(target, draft)
        if dm.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            from .universal_draft import UniversalDraftProposer

            return UniversalDraftProposer(dm, tree_budget=tree_budget, **options)
        return DraftModelProposer(dm, tree_budget=tree_budget, **options)
    raise InvalidParameterError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


__all__ = ["DecodeContext", "Proposer", "make_proposer", "METHODS"]
