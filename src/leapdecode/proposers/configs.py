"""Every decoding method's typed config: its options with their defaults, help and bounds, written
once here.  The registry (``registry.py``) builds proposers from them; each proposer's constructor
takes its defaults from its config's fields (``PldConfig.max_ngram``), and the tree budget a method
drafts when ``tree_budget`` is unset is its config's ``default_tree_budget`` (a number, or how the
proposer derives it), which ``leapdecode methods`` and docs/methods.md show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.config import MethodConfig, option
from ..errors import InvalidParameterError
from .common import CONTEXT_WINDOW, DRAFT_VOCAB, HEAD_WEIGHTS


@dataclass(frozen=True, kw_only=True)
class VanillaConfig(MethodConfig):
    method = "vanilla"
    default_tree_budget = "- (nothing is drafted)"


@dataclass(frozen=True, kw_only=True)
class DraftConfig(MethodConfig):
    method = "draft"
    other_tokenizer_tree_budget: ClassVar[int] = 16  # a draft with another tokenizer: its chain's budget
    draft: str | None = option(None, "draft model name or path (default: the target's registered pair)")
    top_k: int = option(4, "children expanded per node of the draft tree (same tokenizer)", low=1, server_max=16)
    beam: int = option(4, "nodes expanded per tree level (same tokenizer)", low=1, server_max=16)
    max_depth: int = option(8, "deepest draft tree level (same tokenizer)", low=1, server_max=16)
    adaptive: bool = option(True, "size trees from measured costs and calibrated acceptance (greedy); "
                                  "other tokenizer: adapt the chain length")
    tau: float = option(0.05, "stop expanding below this path probability (same tokenizer)", low=0, low_open=True,
                        high=0.999999)
    draft_vocab: int = option(DRAFT_VOCAB, "FR-Spec frequency-ranked vocabulary subset of the draft head "
                                           "(0: whole vocabulary)", low=0)
    staged: bool = option(True, "a suffix automaton speculates for the draft model (greedy)")
    context_window: int | None = option(CONTEXT_WINDOW, "prompt tokens the draft reads besides the attention "
                                                        "sink (None: all)", low=1)
    draft_len: int = option(6, "initial chain length (other tokenizer)", low=1, server_max=64)
    min_draft_len: int = option(2, "shortest adaptive chain (other tokenizer)", low=1)
    max_draft_len: int = option(12, "longest adaptive chain (other tokenizer)", low=1, server_max=64)
    window: int = option(6, "tokens re-tokenized around the anchor (other tokenizer)", low=1, server_max=64)
    anchor_lag: int = option(8, "how far back the re-tokenization anchor trails (other tokenizer)", low=1, server_max=64)

    @classmethod
    def tree_budget_default_text(cls) -> str:
        return f"{cls.default_tree_budget} (another tokenizer: {cls.other_tokenizer_tree_budget})"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_draft_len > self.max_draft_len:
            raise InvalidParameterError(f"option 'min_draft_len' of method 'draft' ({self.min_draft_len}) must be "
                                        f"<= max_draft_len ({self.max_draft_len})")


@dataclass(frozen=True, kw_only=True)
class AutoConfig(MethodConfig):
    method = "auto"
    default_tree_budget = 24  # (when no arm of its own sets one: its head's or draft model's)
    draft: str | None = option(None, "draft model for the hybrid arm (default: the registered pair, if any)")
    use_draft: bool = option(True, "use a draft model arm when one is available (the registered pair only "
                                   "when the target has no trained head; a named draft always)")
    sam_len: int = option(16, "longest suffix-automaton chain", low=1, server_max=64)
    sam_only_match: int = option(12, "a match this long uses the automaton's draft alone", low=1)
    explore: float = option(0.15, "UCB exploration weight", low=0)
    discount: float = option(0.99, "per-step discount of the bandit's evidence", low=0, low_open=True, high=1)
    use_head: bool = option(True, "a head arm when the store holds a trained head for the target "
                                  "(eagle3, eagle, hydra, medusa: the first found)")
    use_memory: bool = option(False, "a memory arm: earlier requests' outputs on this runner (suffix's "
                                     "cross-request memory, its defaults), where they match the text")
    copier: str = option("sam", "the copying arm's drafter: sam (the suffix automaton's chain from the newest "
                                "earlier occurrence) or suffix (the request's own suffix trie, frequency-scored "
                                "branches, sized by calibrated cost; the automaton still gives the bandit its "
                                "match length; measured on the AVX2 EPYC: the same speed as sam on Spec-Bench dev "
                                "and HumanEval, lab notes section 50)", choices=("sam", "suffix"))
    head_graft: bool = option(False, "graft the suffix automaton's continuation onto the head arm's tree, as "
                                     "the hybrid arm does onto the draft model's (measured: more rows, no fewer "
                                     "forwards; lab notes section 45)")

    @classmethod
    def tree_budget_default_text(cls) -> str:
        return f"its head's or draft model's, else {cls.default_tree_budget}"


@dataclass(frozen=True, kw_only=True)
class PldConfig(MethodConfig):
    method = "pld"
    max_ngram: int = option(4, "longest n-gram looked up", low=1, server_max=16)
    min_ngram: int = option(1, "shortest n-gram looked up", low=1)
    draft_len: int = option(10, "tokens copied per match", low=1, server_max=64)
    max_matches: int = option(4, "matches kept per n-gram length", low=1, server_max=16)
    cost_aware: bool = option(True, "greedy: the longest match's chain only, cut by per-depth acceptance and "
                                    "measured verify cost")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_ngram > self.max_ngram:
            raise InvalidParameterError(f"option 'min_ngram' of method 'pld' ({self.min_ngram}) must be <= "
                                        f"max_ngram ({self.max_ngram})")


@dataclass(frozen=True, kw_only=True)
class SamConfig(MethodConfig):
    method = "sam"
    draft_len: int = option(16, "longest chain copied from the match", low=1, server_max=64)
    min_match: int = option(1, "shortest suffix match that drafts", low=1)
    occurrence: str = option("recent", "which earlier occurrence to copy from", choices=("recent", "first"))
    cost_aware: bool = option(True, "cut chains by per-depth acceptance and measured verify cost (greedy)")
    corpus_tokens: list | None = option(None, "token-id lists of a static corpus for a second automaton "
                                              "(API only)")


@dataclass(frozen=True, kw_only=True)
class SuffixConfig(MethodConfig):
    method = "suffix"
    depth: int = option(48, "longest suffix stored per position (match + continuation)", low=2, server_max=64)
    max_match: int = option(16, "longest suffix of the text matched (at most depth - 1: a match needs room for "
                                "its continuation)", low=1)
    spec_factor: float = option(1.0, "a match of n tokens drafts at most spec_factor x n nodes", low=0,
                                low_open=True)
    min_prob: float = option(0.1, "no draft node below this empirical path probability", low=0)
    memory_tokens: int = option(200_000, "earlier requests' output tokens the runner keeps (oldest forgotten "
                                         "first)", low=1, server_max=200000)
    remember_prompts: bool = option(False, "keep earlier requests' prompts too, not only their outputs", server_max=False)
    cost_aware: bool = option(True, "greedy: grow the tree to the budget and verify the prefix worth its "
                                    "measured cost (calibrated acceptance); false: the paper's spec_factor x "
                                    "match length")


@dataclass(frozen=True, kw_only=True)
class RecyclingConfig(MethodConfig):
    method = "recycling"
    default_tree_budget = 28  # at most the template's paths
    k: int = option(8, "top-k candidates kept per token", low=1, server_max=16)
    persist: bool = option(True, "keep the adjacency matrix across generations on this model")
    template: list | None = option(None, "static tree template: rank paths (default: the paper's shape)")

    @classmethod
    def tree_budget_default_text(cls) -> str:
        return f"{cls.default_tree_budget} (at most the template's paths)"


@dataclass(frozen=True, kw_only=True)
class LookaheadConfig(MethodConfig):
    method = "lookahead"
    default_tree_budget = "(guesses + window) x (ngram - 1)"
    window: int = option(5, "Jacobi window width", low=1, server_max=16)
    ngram: int = option(4, "n-gram size of the pool", low=2, server_max=8)
    guesses: int | None = option(None, "n-gram guesses verified per step (default: window)", low=1, server_max=16)


@dataclass(frozen=True, kw_only=True)
class JacobiConfig(MethodConfig):
    method = "jacobi"
    default_tree_budget = "k"
    k: int = option(8, "tokens guessed per Jacobi iteration", low=1, server_max=32)


@dataclass(frozen=True, kw_only=True)
class RestConfig(MethodConfig):
    method = "rest"
    datastore: str | None = option(None, "datastore path (default: the model's stdlib datastore)")
    max_suffix: int = option(16, "longest suffix matched", low=1, server_max=64)
    min_suffix: int = option(2, "shortest suffix matched", low=1)
    draft_len: int = option(10, "continuation length", low=1, server_max=64)
    max_candidates: int = option(128, "continuations read per match", low=1, server_max=1024)
    cost_aware: bool = option(True, "size trees from calibrated frequencies and measured verify cost (greedy)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_suffix > self.max_suffix:
            raise InvalidParameterError(f"option 'min_suffix' of method 'rest' ({self.min_suffix}) must be <= "
                                        f"max_suffix ({self.max_suffix})")


@dataclass(frozen=True, kw_only=True)
class LayerSkipConfig(MethodConfig):
    method = "layerskip"
    default_tree_budget = "k"
    skip: float | None = option(None, "layers skipped: a count, or a fraction in (0, 1) (default 0.3)", low=0)
    k: int = option(6, "longest draft chain", low=1, server_max=32)
    min_conf: float = option(0.6, "stop drafting below this confidence", low=0, high=0.999999)
    update_every: int = option(4, "re-run the layer-selection DP every N verifications", low=1)
    draft_vocab: int = option(DRAFT_VOCAB, "FR-Spec vocabulary subset of the draft head (0: whole)", low=0)


HEAD_WEIGHTS_HELP = ("what the head's linear layers run on: int8 (per-row int8 weights, on the block-quantized "
                     "kernel where it runs, else torch's weight-only int8 kernel), int4 (4-bit weights in groups "
                     "of 32 on the block-quantized kernel), bf16 (the head's float weights as loaded), or auto "
                     "(int8 on the CPU when the target's weights are quantized, else bf16); drafts only: the "
                     "output is the same with each")


@dataclass(frozen=True, kw_only=True)
class MedusaConfig(MethodConfig):
    method = "medusa"
    head: str | None = option(None, "trained head directory, or a directory of them (default: the store's "
                                    "medusa head for the target; `leapdecode train-head`)")
    top_k: int = option(4, "candidates per head (children per node)", low=1, server_max=16)
    draft_vocab: int = option(DRAFT_VOCAB, "FR-Spec vocabulary subset of the shared output head (0: whole)", low=0)
    head_weights: str = option("auto", HEAD_WEIGHTS_HELP, choices=HEAD_WEIGHTS)
    cost_aware: bool = option(True, "greedy: verify only as many of the best candidates (by calibrated head "
                                    "probability) as raise the expected tokens per second under the measured "
                                    "verify cost")


@dataclass(frozen=True, kw_only=True)
class HydraConfig(MethodConfig):
    method = "hydra"
    head: str | None = option(None, "trained head directory, or a directory of them (default: the store's "
                                    "hydra head for the target; `leapdecode train-head`)")
    top_k: int = option(4, "children expanded per node", low=1, server_max=16)
    beam: int = option(4, "nodes expanded per round", low=1, server_max=16)
    draft_vocab: int = option(DRAFT_VOCAB, "FR-Spec vocabulary subset of the shared output head (0: whole)", low=0)
    head_weights: str = option("auto", HEAD_WEIGHTS_HELP, choices=HEAD_WEIGHTS)
    cost_aware: bool = option(True, "greedy: draft another round and keep candidates only while the expected "
                                    "tokens per second rise (calibrated head probabilities, measured verify cost)")


@dataclass(frozen=True, kw_only=True)
class EagleConfig(MethodConfig):
    method = "eagle"
    head: str | None = option(None, "trained head directory, or a directory of them (default: the store's "
                                    "eagle3 or eagle head for the target, else a bundled one; "
                                    "`leapdecode train-head`)")
    top_k: int = option(4, "children expanded per node of the draft tree", low=1, server_max=16)
    beam: int = option(4, "nodes expanded per tree level", low=1, server_max=16)
    max_depth: int = option(6, "deepest draft tree level", low=1, server_max=16)
    draft_vocab: int = option(DRAFT_VOCAB, "FR-Spec vocabulary subset of the shared output head (0: whole)", low=0)
    prompt_window: int = option(128, "last prompt tokens whose features (from the prefill) the head reads",
                                low=0, server_max=1024)
    head_kind: str = option("auto", "which head: eagle3, eagle, or auto (an eagle3 head when one is found, "
                                    "else an eagle head)", choices=("auto", "eagle3", "eagle"))
    head_weights: str = option("auto", HEAD_WEIGHTS_HELP, choices=HEAD_WEIGHTS)
    cost_aware: bool = option(True, "greedy: draft another level and keep nodes only while the expected tokens "
                                    "per second rise (calibrated head confidence, measured head and verify cost)")
