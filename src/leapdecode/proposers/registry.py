"""The method registry: one typed config per decoding method, and what builds its proposer.

``METHODS`` maps a method name to a ``MethodSpec``: its config class (the options a user can
set: API ``options={...}``, CLI ``--option KEY=VALUE``, server ``leapdecode.options``) and a
``build`` function that turns a validated config and a runner into a proposer.  Configs are
validated when built (``method_config``), before any model loads; ``build_proposer`` then loads
what the method needs through the runner (a draft model, a datastore) and hands it to the
proposer, which never loads anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..core.config import MethodConfig
from ..core.proposer import Identity, MemoryKey
from ..errors import HeadFileError, HeadMismatchError, HeadNotFoundError, InvalidParameterError
from .common import AUTO_DRAFT_WINDOW
from .configs import (AutoConfig, DraftConfig, EagleConfig, HydraConfig, JacobiConfig, LayerSkipConfig,
                      LookaheadConfig, MedusaConfig, PldConfig, RecyclingConfig, RestConfig, SamConfig, SuffixConfig,
                      VanillaConfig)

if TYPE_CHECKING:
    from ..core.proposer import Proposer
    from ..core.runner import ModelRunner
    from .suffix import SuffixDecodingProposer



# ------------------------------------------------------------------- builders
def _build_vanilla(cfg: VanillaConfig, runner: "ModelRunner") -> None:
    return None


def _same_vocab(draft, runner: "ModelRunner") -> bool:
    """Do the draft and the runner's target share a tokenizer vocabulary?  Compared once per pair
    and runner (``get_vocab`` builds a dict of every token: ~0.2 s for a 152k vocabulary, 18% of a
    server's time when it was asked for every request; docs/lab-notes/benchmarks.md section 24)."""
    target = runner.model
    pair, same = runner.memory.get(MemoryKey("draft", "same_vocab", (Identity(target),), Identity(draft)), lambda: (
        (draft, target), draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()))
    if pair[0] is draft and pair[1] is target:
        return same
    return draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()  # (never: the key is by identity)


def _build_draft(cfg: DraftConfig, runner: "ModelRunner") -> "Proposer":
    from .draft_model import DraftModelProposer
    from .universal_draft import UniversalDraftProposer

    dm = runner.draft(cfg.draft)
    if not _same_vocab(dm, runner):
        return UniversalDraftProposer(dm, tree_budget=cfg.tree_budget, draft_len=cfg.draft_len,
                                      min_draft_len=cfg.min_draft_len, max_draft_len=cfg.max_draft_len,
                                      adaptive=cfg.adaptive, window=cfg.window, anchor_lag=cfg.anchor_lag)
    return DraftModelProposer(dm, tree_budget=cfg.tree_budget, top_k=cfg.top_k, beam=cfg.beam,
                              max_depth=cfg.max_depth, adaptive=cfg.adaptive, tau=cfg.tau,
                              draft_vocab=cfg.draft_vocab, staged=cfg.staged, context_window=cfg.context_window)


def _build_auto(cfg: AutoConfig, runner: "ModelRunner") -> "Proposer":
    """The draft arm exists when a draft is given or registered for the target and has the same
    tokenizer; a missing or unusable registered draft leaves auto model-free (never an error)."""
    from .auto import AutoProposer
    from .draft_model import DraftModelProposer

    head = _auto_head(cfg, runner) if cfg.use_head else None
    draft_proposer = None
    # With a trained head the registered draft model is left out (a named one is kept): on a CPU its
    # arm's draft steps cost far more than the head's, and the bandit's tries of it cost more than it
    # won (docs/lab-notes/benchmarks.md section 22: auto 0.94x with it against sam's 1.09x on Spec-Bench dev,
    # 1.02x with it against 1.20x without on JSON extraction).
    if cfg.use_draft and (cfg.draft is not None or (runner.model.draft_name and head is None)):
        if cfg.draft is not None:
            dm = runner.draft(cfg.draft)
        else:
            try:
                dm = runner.draft()
            except InvalidParameterError:  # the registered pair is not loaded on this runner
                dm = None
        if dm is not None and _same_vocab(dm, runner):
            draft_proposer = DraftModelProposer(dm, tree_budget=cfg.tree_budget, context_window=AUTO_DRAFT_WINDOW,
                                                defer_prefill=True)  # a generation may never use the arm
    # the memory arm: suffix's defaults, so auto and suffix on one runner share one memory
    memory = _build_suffix(SuffixConfig(tree_budget=cfg.tree_budget), runner, local=False) if cfg.use_memory else None
    # the copying arm: the automaton itself, or the request's own suffix trie (suffix's defaults)
    copier = (_build_suffix(SuffixConfig(tree_budget=cfg.tree_budget), runner, memory=False)
              if cfg.copier == "suffix" else None)
    return AutoProposer(draft_proposer, tree_budget=cfg.tree_budget, sam_len=cfg.sam_len,
                        sam_only_match=cfg.sam_only_match, explore=cfg.explore, discount=cfg.discount,
                        head_proposer=head, memory_proposer=memory, head_graft=cfg.head_graft,
                        copier_proposer=copier)


AUTO_HEAD_KINDS = ("eagle3", "eagle", "hydra", "medusa")  # auto's preference among the stored heads


def _auto_head(cfg: AutoConfig, runner: "ModelRunner") -> "Proposer | None":
    """A proposer over the store's trained head for the target (the first kind of
    ``AUTO_HEAD_KINDS`` found), or None: no head, or a backend heads cannot read."""
    from .heads.common import reads_target_head
    from .heads.store import KIND_METHOD, stored_kind

    model = runner.model
    if not reads_target_head(model):
        return None
    kind = runner.memory.get(MemoryKey("auto", "head_kind"), lambda: stored_kind(AUTO_HEAD_KINDS, model))
    if kind is None:
        return None
    method = KIND_METHOD[kind]
    head_cfg = METHODS[method].config.from_options({"tree_budget": cfg.tree_budget} if cfg.tree_budget else {})
    try:
        proposer = METHODS[method].build(head_cfg, runner)
    except (HeadFileError, HeadMismatchError, HeadNotFoundError):  # a damaged store entry: auto goes on without it
        return None
    return proposer


def _build_pld(cfg: PldConfig, runner: "ModelRunner") -> "Proposer":
    from .pld import PromptLookupProposer

    return PromptLookupProposer(tree_budget=cfg.tree_budget, max_ngram=cfg.max_ngram, min_ngram=cfg.min_ngram,
                                draft_len=cfg.draft_len, max_matches=cfg.max_matches,
                                cost_aware=cfg.cost_aware)


def _build_sam(cfg: SamConfig, runner: "ModelRunner") -> "Proposer":
    from .sam import SuffixAutomatonProposer

    return SuffixAutomatonProposer(tree_budget=cfg.tree_budget, draft_len=cfg.draft_len, min_match=cfg.min_match,
                                   occurrence=cfg.occurrence, cost_aware=cfg.cost_aware,
                                   corpus_tokens=cfg.corpus_tokens)


def _build_suffix(cfg: SuffixConfig, runner: "ModelRunner", local: bool = True,
                  memory: bool = True) -> "SuffixDecodingProposer":
    from .suffix import SuffixDecodingProposer

    return SuffixDecodingProposer(tree_budget=cfg.tree_budget, depth=cfg.depth, max_match=cfg.max_match,
                                  spec_factor=cfg.spec_factor, min_prob=cfg.min_prob,
                                  memory_tokens=cfg.memory_tokens, remember_prompts=cfg.remember_prompts,
                                  cost_aware=cfg.cost_aware, local=local, memory=memory)


def _build_recycling(cfg: RecyclingConfig, runner: "ModelRunner") -> "Proposer":
    from .recycling import TokenRecyclingProposer

    return TokenRecyclingProposer(tree_budget=cfg.tree_budget, k=cfg.k, persist=cfg.persist, template=cfg.template)


def _build_lookahead(cfg: LookaheadConfig, runner: "ModelRunner") -> "Proposer":
    from .lookahead import LookaheadProposer

    return LookaheadProposer(tree_budget=cfg.tree_budget, window=cfg.window, ngram=cfg.ngram, guesses=cfg.guesses)


def _build_jacobi(cfg: JacobiConfig, runner: "ModelRunner") -> "Proposer":
    from .jacobi import JacobiProposer

    return JacobiProposer(tree_budget=cfg.tree_budget, k=cfg.k)


def _build_rest(cfg: RestConfig, runner: "ModelRunner") -> "Proposer":
    from .rest import RestProposer, resolve_datastore

    ds = resolve_datastore(runner, cfg.datastore)
    return RestProposer(ds, tree_budget=cfg.tree_budget, max_suffix=cfg.max_suffix, min_suffix=cfg.min_suffix,
                        draft_len=cfg.draft_len, max_candidates=cfg.max_candidates, cost_aware=cfg.cost_aware)


def _build_layerskip(cfg: LayerSkipConfig, runner: "ModelRunner") -> "Proposer":
    from .layerskip import LayerSkipProposer

    skip = cfg.skip
    if isinstance(skip, float) and skip.is_integer():
        skip = int(skip)
    return LayerSkipProposer(runner.model, tree_budget=cfg.tree_budget, skip=skip, k=cfg.k, min_conf=cfg.min_conf,
                             update_every=cfg.update_every, draft_vocab=cfg.draft_vocab)


def _trained_head(kind: str | tuple[str, ...], path: str | None, runner: "ModelRunner"):
    """The target's trained head of ``kind`` (or of the first of several kinds found; loaded once per
    runner)."""
    from .heads.common import require_native
    from .heads.store import load_head

    require_native(runner.model, kind if isinstance(kind, str) else kind[-1])
    return runner.memory.get(MemoryKey("head", "trained", (kind, path)), lambda: load_head(kind, runner.model, path))[0]


def _build_medusa(cfg: MedusaConfig, runner: "ModelRunner") -> "Proposer":
    from .heads.medusa import MedusaProposer

    return MedusaProposer(runner.model, _trained_head("medusa", cfg.head, runner), tree_budget=cfg.tree_budget,
                          top_k=cfg.top_k, draft_vocab=cfg.draft_vocab, head_weights=cfg.head_weights,
                          cost_aware=cfg.cost_aware)


def _build_hydra(cfg: HydraConfig, runner: "ModelRunner") -> "Proposer":
    from .heads.hydra import HydraProposer

    return HydraProposer(runner.model, _trained_head("hydra", cfg.head, runner), tree_budget=cfg.tree_budget,
                         top_k=cfg.top_k, beam=cfg.beam, draft_vocab=cfg.draft_vocab,
                         head_weights=cfg.head_weights, cost_aware=cfg.cost_aware)


def _build_eagle(cfg: EagleConfig, runner: "ModelRunner") -> "Proposer":
    from .heads.eagle import EagleProposer

    kinds = ("eagle3", "eagle") if cfg.head_kind == "auto" else cfg.head_kind
    return EagleProposer(runner.model, _trained_head(kinds, cfg.head, runner), tree_budget=cfg.tree_budget,
                         top_k=cfg.top_k, beam=cfg.beam, max_depth=cfg.max_depth, draft_vocab=cfg.draft_vocab,
                         prompt_window=cfg.prompt_window, head_weights=cfg.head_weights, cost_aware=cfg.cost_aware)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config: type[MethodConfig]
    build: Callable[[Any, "ModelRunner"], "Proposer | None"]
    summary: str
    uses_draft_model: bool = False


METHODS: dict[str, MethodSpec] = {s.name: s for s in (
    MethodSpec("auto", AutoConfig, _build_auto,
               "a bandit choosing per step between the suffix automaton, draft model + automaton, or no draft",
               uses_draft_model=True),
    MethodSpec("vanilla", VanillaConfig, _build_vanilla, "one target forward per token, nothing drafted"),
    MethodSpec("draft", DraftConfig, _build_draft, "a smaller model drafts a dynamic token tree (or a "
               "re-tokenized chain when its tokenizer differs)", uses_draft_model=True),
    MethodSpec("pld", PldConfig, _build_pld, "n-gram lookup in prompt + output"),
    MethodSpec("sam", SamConfig, _build_sam, "suffix automaton over prompt + output"),
    MethodSpec("suffix", SuffixConfig, _build_suffix, "frequency-scored suffix trees over this request and the "
               "outputs of earlier requests on the same model (cross-request memory)"),
    MethodSpec("recycling", RecyclingConfig, _build_recycling, "top-k candidates recycled from earlier forwards"),
    MethodSpec("lookahead", LookaheadConfig, _build_lookahead, "Jacobi iterations with an n-gram pool"),
    MethodSpec("jacobi", JacobiConfig, _build_jacobi, "Jacobi iterations in the same forward"),
    MethodSpec("rest", RestConfig, _build_rest, "retrieval from a suffix-array datastore"),
    MethodSpec("layerskip", LayerSkipConfig, _build_layerskip, "the target itself with some layers skipped"),
    MethodSpec("medusa", MedusaConfig, _build_medusa, "trained Medusa heads on the target's last hidden state "
               "draft a tree (needs `leapdecode train-head`)"),
    MethodSpec("hydra", HydraConfig, _build_hydra, "trained Hydra heads, each reading the tokens drafted "
               "before it, draft a dynamic tree (needs `leapdecode train-head`)"),
    MethodSpec("eagle", EagleConfig, _build_eagle, "a trained EAGLE or EAGLE-3 head, autoregressive over the "
               "target's features, drafts a dynamic tree (needs `leapdecode train-head`)"),
)}
DEFAULT_METHOD = "auto"


def method_spec(method: str) -> MethodSpec:
    if not isinstance(method, str) or method not in METHODS:
        raise InvalidParameterError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return METHODS[method]


def method_config(method: "str | MethodConfig", options: dict[str, Any] | None = None) -> MethodConfig:
    """A validated config: from a method name and its options, or a config given as it is."""
    if isinstance(method, MethodConfig):
        if options:
            return method.from_options({**method.as_dict(), **options})
        return method
    if options is not None and not isinstance(options, dict):
        raise InvalidParameterError(f"options must be a mapping of option names to values, got {options!r:.80}")
    return method_spec(method).config.from_options(options)


def build_proposer(cfg: MethodConfig, runner: "ModelRunner") -> "Proposer | None":
    """The proposer of a validated config (``None`` for vanilla), with what it needs loaded."""
    proposer = method_spec(cfg.method).build(cfg, runner)
    if proposer is not None:
        budget = getattr(proposer, "default_budget", None)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise TypeError(f"proposer of method {cfg.method!r} has no default_budget (an integer >= 1)")
    return proposer


# ------------------------------------------------------------------- a server's bounds on requests
LIMIT_FLAG = "leapdecode serve --request-limit"


def request_limits(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"METHOD.OPTION": bound}``: the most a server's request may ask of every option that sizes
    shared or long-lived state or a step's work (each option's ``server_max``, written once in
    ``configs.py``), with the operator's ``overrides`` (``parse_request_limits``)."""
    limits = {f"{name}.{option}": bound for name, spec in METHODS.items()
              for option, bound in spec.config.server_limits().items()}
    limits.update(overrides or {})
    return limits


def parse_request_limits(items: list[str] | None) -> dict[str, Any]:
    """``--request-limit`` arguments (``suffix.depth=128``; ``tree_budget=32``: every method's) as
    ``request_limits`` overrides, typed as their options; an unknown or unbounded option, or a bound
    its option would refuse, is an ``InvalidParameterError`` naming the argument."""
    bounded = request_limits()
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        keys = [k for k in bounded if k.endswith(".tree_budget")] if key == "tree_budget" else [key]
        if not sep or not key or any(k not in bounded for k in keys):
            raise InvalidParameterError(
                f"--request-limit takes METHOD.OPTION=VALUE for an option that sizes a request's state or work "
                f"(or tree_budget=N for every method), got {item!r}; bounded options: {', '.join(sorted(bounded))}")
        for k in keys:
            method, option = k.split(".", 1)
            value = METHODS[method].config.parse_option(option, text.strip())
            if value is not None and not isinstance(value, bool):
                METHODS[method].config.from_options({option: value})  # a bound the option itself accepts
            out[k] = value
    return out


def check_request_limits(cfg: MethodConfig, given: Any, limits: dict[str, Any]) -> None:
    """Refuse a request's options (``given``: the names it set) above this server's ``limits``
    (``request_limits``): an ``InvalidParameterError`` whose ``field`` is the option
    (``options.NAME``) and whose message names the bound and the setting that raises it."""
    for name in given:
        bound = limits.get(f"{cfg.method}.{name}")
        value = getattr(cfg, name, None)
        if bound is None or value is None:
            continue
        if isinstance(bound, bool):
            over = bool(value) and not bound
            why = (f"this server does not let a request turn on option {name!r} of method {cfg.method!r} "
                   f"({LIMIT_FLAG} {cfg.method}.{name}=true allows it)")
        else:
            over = value > bound
            why = (f"option {name!r} of method {cfg.method!r} is {value!r}; this server allows a request at most "
                   f"{bound!r} ({LIMIT_FLAG} {cfg.method}.{name}=N raises it)")
        if over:
            error = InvalidParameterError(why)
            error.field = f"options.{name}"
            raise error
