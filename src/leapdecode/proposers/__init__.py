"""Proposers: one file per drafting method.  ``make_proposer`` maps a method name to one."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidParameterError
from .base import DecodeContext, Proposer

METHODS = ["vanilla", "draft", "pld", "sam", "recycling"]
METHODS += ["lookahead", "jacobi"]
METHODS += ["rest"]
METHODS += ["layerskip"]
METHODS += ["auto"]

# model-free drafters: method -> (module, class)
_MODEL_FREE = {
    "pld": ("pld", "PromptLookupProposer"),
    "sam": ("sam", "SuffixAutomatonProposer"),
    "recycling": ("recycling", "TokenRecyclingProposer"),
    "lookahead": ("lookahead", "LookaheadProposer"),
    "jacobi": ("jacobi", "JacobiProposer"),
}


def _model_free(method: str, tree_budget: int | None, options: dict[str, Any]) -> Proposer:
    import importlib
    import inspect

    module, cls_name = _MODEL_FREE[method]
    cls = getattr(importlib.import_module(f".{module}", __name__), cls_name)
    accepted = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "tree_budget")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InvalidParameterError(
            f"method {method!r} does not take option(s) {', '.join(unknown)}; it takes: {', '.join(accepted)}"
        )
    return cls(tree_budget=tree_budget, **options)


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
    if method == "auto":
        from .auto import make_auto_proposer

        return make_auto_proposer(target, draft, tree_budget, options)
    if method == "rest":
        from .rest import make_rest_proposer

        return make_rest_proposer(target, tree_budget, options)
    if method == "layerskip":
        from .layerskip import make_layerskip_proposer

        return make_layerskip_proposer(target, tree_budget, options)
    if method in _MODEL_FREE:
        return _model_free(method, tree_budget, options)
    raise InvalidParameterError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


__all__ = ["DecodeContext", "Proposer", "make_proposer", "METHODS"]
