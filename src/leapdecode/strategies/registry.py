"""The strategy registry: one typed config per decoding strategy, and the search that runs it.

A *strategy* decides which output to produce (search over hypotheses, sampling without
replacement); a *method* (``proposers/registry.py``) only makes producing it faster.  ``STRATEGIES``
maps a strategy name to a ``StrategySpec``: its config class (the options a user can set: API
``strategy_options={...}`` or a config object, CLI ``--num-beams``/``--n``/``--length-penalty``/
``--patience``/``--strategy-option KEY=VALUE``, server ``leapdecode.strategy_options``) and the
``TreeSearch`` subclass that runs it.  No strategy (``None``) is the default: greedy decoding or
sampling by the generation loop, with any method.

Configs are validated when built (``strategy_config``), before any model loads; the cross-field
rules (``num_return_sequences`` at most what the strategy keeps, beams divisible into groups) are
checked there too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.config import option
from ..core.generate import Generation
from ..errors import InvalidParameterError, ScorerError
from .adadec import AdaDec
from .beam import BeamSearch
from .best_first import BestFirstBeamSearch
from .contrastive import ContrastiveDecoding
from .contrastive_search import ContrastiveSearch
from .dola import DoLa, candidate_layers
from .search import StrategyConfig, TreeSearch
from .stochastic_beam import ConditionalPoissonBeamSearch, StochasticBeamSearch
# test-time scaling (issue 16, section 3): N samples of one prompt in one batch
from collections.abc import Callable  # noqa: E402

from .best_of_n import BestOfN  # noqa: E402
from .first_finish import FirstFinish  # noqa: E402
from .parallel import ParallelSamples  # noqa: E402
from .scorers import Extractor, check_scorer_spec, make_scorer  # noqa: E402
from .self_consistency import SelfConsistency  # noqa: E402
from .speculative_rejection import SpeculativeRejection  # noqa: E402

if TYPE_CHECKING:
    from ..core.runner import ModelRunner
    from ..core.task import Task

MAX_BEAMS = 256  # most hypotheses alive at once (each is a row of every forward)


def _num_beams(default: int) -> Any:
    return option(default, "hypotheses kept per round (the beam width k)", low=1, high=MAX_BEAMS)


def _returns() -> Any:
    return option(None, "hypotheses returned, best first (None: all the strategy keeps: num_beams, or "
                        "ceil(patience * num_beams) with a patience)", low=1)


def _check_returns(cfg: "StrategyConfig", kept: int) -> None:
    n = getattr(cfg, "num_return_sequences", None)
    if n is not None and n > kept:
        raise InvalidParameterError(f"option 'num_return_sequences' of strategy {cfg.strategy!r} ({n}) must be "
                                    f"<= the {kept} hypotheses it keeps (num_beams"
                                    f"{' x patience' if getattr(cfg, 'patience', 1.0) != 1.0 else ''})")


EARLY_STOPPING = (True, False, "never")


@dataclass(frozen=True, kw_only=True)
class BeamConfig(StrategyConfig):
    strategy = "beam"
    num_beams: int = _num_beams(4)
    num_return_sequences: int | None = _returns()
    length_penalty: float = option(1.0, "finished scores are sum log p / length ** length_penalty "
                                        "(transformers' convention; > 0 favours longer outputs)")
    early_stopping: bool | str = option(False, "True: stop when num_beams hypotheses finished; False: "
                                               "transformers' heuristic; 'never': the canonical rule",
                                        choices=EARLY_STOPPING)
    patience: float = option(1.0, "patience factor (Kasai et al., 2022): the finished pool holds "
                                  "ceil(patience * num_beams) hypotheses; 1 is plain beam search",
                             low=0, low_open=True, high=64)

    @property
    def kept(self) -> int:
        return max(1, math.ceil(self.patience * self.num_beams - 1e-9))

    @property
    def returns(self) -> int:
        return self.kept if self.num_return_sequences is None else self.num_return_sequences

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_returns(self, self.kept)


@dataclass(frozen=True, kw_only=True)
class DiverseBeamConfig(StrategyConfig):
    strategy = "diverse-beam"
    num_beams: int = _num_beams(4)
    num_beam_groups: int = option(2, "groups of num_beams / num_beam_groups beams each", low=1)
    diversity_penalty: float = option(0.5, "subtracted from a token's log-probability per beam of an earlier "
                                           "group that chose it this round (Hamming diversity)", low=0)
    num_return_sequences: int | None = _returns()
    length_penalty: float = option(1.0, "as for beam")
    early_stopping: bool | str = option(False, "as for beam (per group)", choices=EARLY_STOPPING)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_beams % self.num_beam_groups:
            raise InvalidParameterError(f"option 'num_beams' of strategy 'diverse-beam' ({self.num_beams}) must be "
                                        f"divisible by num_beam_groups ({self.num_beam_groups})")
        _check_returns(self, self.num_beams)


@dataclass(frozen=True, kw_only=True)
class BestFirstBeamConfig(StrategyConfig):
    strategy = "best-first-beam"
    num_beams: int = option(4, "the beam constraint k: at most k hypotheses of each length are expanded",
                            low=1, high=MAX_BEAMS)
    num_return_sequences: int | None = option(None, "complete hypotheses returned, in the order popped "
                                                    "(best first; None: 1)", low=1)

    @property
    def width(self) -> int:
        return self.num_beams

    @property
    def returns(self) -> int:
        return 1 if self.num_return_sequences is None else self.num_return_sequences

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_returns(self, self.num_beams)


@dataclass(frozen=True, kw_only=True)
class StochasticBeamConfig(StrategyConfig):
    strategy = "stochastic-beam"
    stochastic = True
    num_beams: int = option(4, "sequences sampled without replacement (k)", low=1, high=MAX_BEAMS)
    num_return_sequences: int | None = option(None, "sampled sequences returned, in the order of their "
                                                    "Gumbel keys (None: all k)", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_returns(self, self.num_beams)


@dataclass(frozen=True, kw_only=True)
class CPSBeamConfig(StrategyConfig):
    strategy = "cps-beam"
    stochastic = True
    num_beams: int = option(4, "size of each round's conditional Poisson sample (k)", low=1, high=MAX_BEAMS)
    num_return_sequences: int | None = option(None, "sequences returned, most probable first (None: all k)", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_returns(self, self.num_beams)


def _one_output() -> Any:
    return option(None, "hypotheses returned: the one output (None: 1)", low=1, high=1)


@dataclass(frozen=True, kw_only=True)
class ContrastiveSearchConfig(StrategyConfig):
    strategy = "contrastive-search"
    top_k: int = option(4, "candidates per step: the k most probable next tokens, scored in one tree forward "
                           "(1: greedy)", low=1, high=MAX_BEAMS)
    penalty_alpha: float = option(0.6, "alpha: weight of the degeneration penalty (max cosine similarity of a "
                                       "candidate's last-layer hidden state to the context's) against the "
                                       "probability (0: greedy)", low=0, high=1)
    num_return_sequences: int | None = _one_output()

    def pending_nodes(self, max_new_tokens: int) -> int:
        return self.top_k + 1


@dataclass(frozen=True, kw_only=True)
class ContrastiveConfig(StrategyConfig):
    strategy = "contrastive"
    amateur: str | None = option(None, "the amateur model, loaded through the runner like a draft model (a "
                                       "registered name or a path; None: the target's registered draft, e.g. "
                                       "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    alpha: float = option(0.1, "adaptive plausibility constraint: only tokens with p_expert >= alpha * max p_expert "
                               "are candidates", low=0, low_open=True, high=1)
    amateur_temperature: float = option(1.0, "tau: the amateur's log-probabilities are taken at this temperature",
                                        low=0, low_open=True, high=100)
    num_beams: int = option(1, "beam width over the summed contrastive objective (1: greedy, the token-level "
                               "maximum)", low=1, high=MAX_BEAMS)
    num_return_sequences: int | None = option(None, "finished hypotheses returned, best score first "
                                                    "(None: 1)", low=1)

    @property
    def returns(self) -> int:
        return 1 if self.num_return_sequences is None else self.num_return_sequences

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_returns(self, self.num_beams)


@dataclass(frozen=True, kw_only=True)
class DoLaConfig(StrategyConfig):
    strategy = "dola"
    dola_layers: list | str = option("high", "candidate premature layers: 'high' or 'low' (the authors' buckets: "
                                             "the upper or lower half of the layers, every second one) or a list "
                                             "of layer indices (0: the embeddings, i: after layer i)")
    relative_top: float = option(0.1, "adaptive plausibility constraint: only tokens with p_final >= relative_top "
                                      "* max p_final are candidates (the paper's alpha)", low=0, low_open=True, high=1)
    repetition_penalty: float = option(1.0, "Keskar et al.'s penalty on tokens already in the text, applied to the "
                                            "contrasted scores (the paper uses 1.2; 1: none)",
                                       low=0, low_open=True, high=100)
    final_norm: bool = option(False, "apply the final norm to the early hidden states before the head (the "
                                     "authors' code and transformers do not)")
    num_return_sequences: int | None = _one_output()

    def pending_nodes(self, max_new_tokens: int) -> int:
        return 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.dola_layers, str) and self.dola_layers not in ("low", "high"):
            raise InvalidParameterError(f"option 'dola_layers' of strategy 'dola' must be 'low', 'high' or a list "
                                        f"of layer indices, got {self.dola_layers!r}")
        if isinstance(self.dola_layers, list) and (not self.dola_layers or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.dola_layers)):
            raise InvalidParameterError(f"option 'dola_layers' of strategy 'dola' must list layer indices >= 0, "
                                        f"got {self.dola_layers!r}")


@dataclass(frozen=True, kw_only=True)
class AdaDecConfig(StrategyConfig):
    strategy = "adadec"
    entropy_threshold: float = option(1.0, "pause and rerank where the next-token entropy (nats) reaches this (the "
                                           "paper learns it per model: 0.6 to 1.3 for its 0.6B-8B models)", low=0)
    lookahead_length: int = option(5, "L: greedy lookahead tokens scored after each candidate", low=1, high=64)
    lookahead_beam_size: int = option(3, "B: candidates (the most probable tokens) reranked at a pause",
                                      low=1, high=MAX_BEAMS)
    num_return_sequences: int | None = _one_output()

    def pending_nodes(self, max_new_tokens: int) -> int:
        return self.lookahead_beam_size * self.lookahead_length + 1


# ---------------------------------------------------------------------- builders
def _beam(cfg: BeamConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
          temperature: float, seed: int | None) -> TreeSearch:
    return BeamSearch(runner, prompt_ids, cfg, max_new_tokens, patience=cfg.patience)


def _diverse(cfg: DiverseBeamConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
             temperature: float, seed: int | None) -> TreeSearch:
    return BeamSearch(runner, prompt_ids, cfg, max_new_tokens, groups=cfg.num_beam_groups,
                      diversity_penalty=cfg.diversity_penalty)


def _best_first(cfg: BestFirstBeamConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                temperature: float, seed: int | None) -> TreeSearch:
    return BestFirstBeamSearch(runner, prompt_ids, cfg, max_new_tokens)


def _stochastic(cfg: StochasticBeamConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                temperature: float, seed: int | None) -> TreeSearch:
    return StochasticBeamSearch(runner, prompt_ids, cfg, max_new_tokens, temperature=temperature, seed=seed)


def _cps(cfg: CPSBeamConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
         temperature: float, seed: int | None) -> TreeSearch:
    return ConditionalPoissonBeamSearch(runner, prompt_ids, cfg, max_new_tokens, temperature=temperature, seed=seed)


def _contrastive_search(cfg: ContrastiveSearchConfig, runner: "ModelRunner", prompt_ids: list[int],
                        max_new_tokens: int, temperature: float, seed: int | None) -> TreeSearch:
    return ContrastiveSearch(runner, prompt_ids, cfg, max_new_tokens)


def _contrastive(cfg: ContrastiveConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                 temperature: float, seed: int | None) -> TreeSearch:
    if cfg.amateur is None and runner.model.draft_name is None:
        raise InvalidParameterError(f"strategy 'contrastive' needs an amateur model: {runner.model.name} has no "
                                    "registered draft to use as one; give the option amateur=NAME")
    amateur = runner.draft(cfg.amateur)  # loaded like a draft model (or refused where the runner loads none)
    return ContrastiveDecoding(runner, prompt_ids, cfg, max_new_tokens, amateur=amateur)


def _dola(cfg: DoLaConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
          temperature: float, seed: int | None) -> TreeSearch:
    decoder = runner.model.model
    if getattr(decoder, "backend", None) != "native":
        raise InvalidParameterError(f"strategy 'dola' needs the native backend (its early-exit heads read the "
                                    f"layers' hidden states); {runner.model.name} runs on {decoder.backend!r}")
    layers = candidate_layers(cfg.dola_layers, decoder.cfg.n_layers, decoder.cfg.tie_word_embeddings)
    return DoLa(runner, prompt_ids, cfg, max_new_tokens, layers=layers)


def _adadec(cfg: AdaDecConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
            temperature: float, seed: int | None) -> TreeSearch:
    return AdaDec(runner, prompt_ids, cfg, max_new_tokens)


# ---------------------------------------------------------------------- test-time scaling
def _num_samples(default: int) -> Any:
    return option(default, "samples drawn (N): one batch on the shared prompt, each a plain sampled generation",
                  low=1, high=MAX_BEAMS)


_SCORER_HELP = ("'mean-logprob' or 'sum-logprob' (the model's own log-likelihood of the sample, temperature 1), "
                "'tests' (run the option tests on prompt + sample in a sandboxed subprocess: 1 pass, 0 fail), or a "
                "Python callable sample -> float (API only)")


@dataclass(frozen=True, kw_only=True)
class ScoredSamplesConfig(StrategyConfig):
    """What the scored test-time scaling strategies share: a subclass declares ``num_samples``,
    ``num_return_sequences`` and the scorer's options (``_scorer_options``' fields)."""

    stochastic = True
    parallel = True

    @property
    def width(self) -> int:
        return self.num_samples

    @property
    def returns(self) -> int:
        return 1 if self.num_return_sequences is None else self.num_return_sequences

    def pending_nodes(self, max_new_tokens: int) -> int:
        return 1

    def make_scorer(self, spec: Any = None) -> Any:
        return make_scorer(self.scorer if spec is None else spec, self.tests, self.entry_point, self.test_timeout,
                           self.test_memory_mb, self.include_prompt)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("scorer", "partial_scorer"):
            if hasattr(self, name):
                check_scorer_spec(getattr(self, name), name)
        if "tests" in (self.scorer, getattr(self, "partial_scorer", None)):
            self.make_scorer("tests")  # a ScorerError when the tests are missing
        _check_returns(self, self.num_samples)


def _scorer() -> Any:
    return option("mean-logprob", "what ranks the finished samples: " + _SCORER_HELP)


def _tests() -> Any:
    return option(None, "scorer 'tests': HumanEval-style test code (a check(candidate) function)")


def _entry_point() -> Any:
    return option(None, "scorer 'tests': the function check() is called with (None: the tests run themselves)")


def _include_prompt() -> Any:
    return option(True, "scorer 'tests': the tested program is prompt + sample (HumanEval: the prompt is the "
                        "signature and docstring), else the sample alone")


def _test_timeout() -> Any:
    return option(5.0, "scorer 'tests': seconds a test run may take (wall clock and CPU) before it is killed",
                  low=0, low_open=True, high=600)


def _test_memory_mb() -> Any:
    return option(512, "scorer 'tests': address-space limit of a test run (MiB)", low=64, high=65536)


@dataclass(frozen=True, kw_only=True)
class BestOfNConfig(ScoredSamplesConfig):
    strategy = "best-of-n"
    num_samples: int = _num_samples(4)
    scorer: str | Callable = _scorer()
    tests: str | None = _tests()
    entry_point: str | None = _entry_point()
    include_prompt: bool = _include_prompt()
    test_timeout: float = _test_timeout()
    test_memory_mb: int = _test_memory_mb()
    num_return_sequences: int | None = option(None, "samples returned, best score first (None: 1)", low=1)


@dataclass(frozen=True, kw_only=True)
class SelfConsistencyConfig(StrategyConfig):
    strategy = "self-consistency"
    stochastic = True
    parallel = True
    num_samples: int = _num_samples(8)
    extractor: str | Callable = option("auto", "the answer of a sample: 'auto' (its last number, else its last "
                                               "non-empty line), 'number', 'last-line', or a Python callable "
                                               "text -> answer or None (API only)")
    num_return_sequences: int | None = option(None, "distinct answers returned, most votes first (None: 1)", low=1)

    @property
    def width(self) -> int:
        return self.num_samples

    @property
    def returns(self) -> int:
        return 1 if self.num_return_sequences is None else self.num_return_sequences

    def pending_nodes(self, max_new_tokens: int) -> int:
        return 1

    def __post_init__(self) -> None:
        super().__post_init__()
        Extractor(self.extractor)  # a ScorerError for an unknown name or a non-callable
        _check_returns(self, self.num_samples)


@dataclass(frozen=True, kw_only=True)
class FirstFinishConfig(StrategyConfig):
    strategy = "first-finish"
    stochastic = True
    parallel = True
    num_samples: int = _num_samples(4)
    num_return_sequences: int | None = _one_output()

    @property
    def width(self) -> int:
        return self.num_samples

    @property
    def returns(self) -> int:
        return 1

    def pending_nodes(self, max_new_tokens: int) -> int:
        return 1


@dataclass(frozen=True, kw_only=True)
class SpeculativeRejectionConfig(ScoredSamplesConfig):
    strategy = "speculative-rejection"
    num_samples: int = _num_samples(16)
    interval: int = option(32, "decided tokens between checkpoints", low=1)
    rejection_rate: float = option(0.5, "alpha: the fraction of the scored samples stopped at each checkpoint",
                                   low=0, high=1)
    partial_scorer: str | Callable = option("mean-logprob", "what scores a sample's first tokens at a checkpoint: "
                                                            "'mean-logprob', 'sum-logprob' or a Python callable "
                                                            "sample -> float (API only; sample.finished is False)")
    scorer: str | Callable = _scorer()
    tests: str | None = _tests()
    entry_point: str | None = _entry_point()
    include_prompt: bool = _include_prompt()
    test_timeout: float = _test_timeout()
    test_memory_mb: int = _test_memory_mb()
    num_return_sequences: int | None = option(None, "finished samples returned, best score first (None: 1); "
                                                    "checkpoints never keep fewer", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.partial_scorer == "tests":
            raise ScorerError("strategy 'speculative-rejection': scorer 'tests' cannot score a partial sample; give "
                              "partial_scorer 'mean-logprob', 'sum-logprob' or a callable")


def _scaling_args(cfg: StrategyConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                  sampling: Any, method: Any, stop: Any) -> tuple:
    if sampling is None or method is None:
        raise InvalidParameterError(f"strategy {cfg.strategy!r} needs the sampling parameters and the method "
                                    "(build it through leapdecode.start_generation)")
    return (runner, prompt_ids, cfg, max_new_tokens, sampling, method, stop)


def _best_of_n(cfg: BestOfNConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
               sampling: Any = None, method: Any = None, stop: Any = None) -> TreeSearch:
    return BestOfN(*_scaling_args(cfg, runner, prompt_ids, max_new_tokens, sampling, method, stop),
                   scorer=cfg.make_scorer())


def _self_consistency(cfg: SelfConsistencyConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                      sampling: Any = None, method: Any = None, stop: Any = None) -> TreeSearch:
    return SelfConsistency(*_scaling_args(cfg, runner, prompt_ids, max_new_tokens, sampling, method, stop),
                           extractor=Extractor(cfg.extractor))


def _first_finish(cfg: FirstFinishConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                  sampling: Any = None, method: Any = None, stop: Any = None) -> TreeSearch:
    return FirstFinish(*_scaling_args(cfg, runner, prompt_ids, max_new_tokens, sampling, method, stop))


def _speculative_rejection(cfg: SpeculativeRejectionConfig, runner: "ModelRunner", prompt_ids: list[int],
                           max_new_tokens: int, sampling: Any = None, method: Any = None,
                           stop: Any = None) -> TreeSearch:
    return SpeculativeRejection(*_scaling_args(cfg, runner, prompt_ids, max_new_tokens, sampling, method, stop),
                                scorer=cfg.make_scorer(), partial_scorer=cfg.make_scorer(cfg.partial_scorer),
                                interval=cfg.interval, rejection_rate=cfg.rejection_rate)


@dataclass(frozen=True)
class StrategySpec:
    name: str
    config: type[StrategyConfig]
    build: Any  # (cfg, runner, prompt_ids, max_new_tokens, temperature, seed) -> TreeSearch
    summary: str
    paper: str


STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("beam", BeamConfig, _beam,
                 "beam search with length penalty, early stopping and patience (transformers' rules)",
                 '"Beam Decoding with Controlled Patience" (Kasai et al., 2022) for the patience factor'),
    StrategySpec("diverse-beam", DiverseBeamConfig, _diverse,
                 "groups of beams, each penalized for the tokens earlier groups chose",
                 '"Diverse Beam Search" (Vijayakumar et al., 2016)'),
    StrategySpec("best-first-beam", BestFirstBeamConfig, _best_first,
                 "a priority queue under the beam constraint; stops at the first complete hypotheses",
                 '"Best-First Beam Search" (Meister, Vieira, Cotterell, 2020)'),
    StrategySpec("stochastic-beam", StochasticBeamConfig, _stochastic,
                 "k sequences sampled without replacement (Gumbel-top-k)",
                 '"Stochastic Beams and Where to Find Them" (Kool, van Hoof, Welling, 2019)'),
    StrategySpec("cps-beam", CPSBeamConfig, _cps,
                 "each round a conditional Poisson sample of k candidates",
                 '"Conditional Poisson Stochastic Beams" (Meister, Amini, Vieira, Cotterell, 2021)'),
    StrategySpec("contrastive-search", ContrastiveSearchConfig, _contrastive_search,
                 "top-k candidates scored by probability minus a degeneration penalty over hidden states",
                 '"A Contrastive Framework for Neural Text Generation" (Su et al., 2022)'),
    StrategySpec("contrastive", ContrastiveConfig, _contrastive,
                 "expert minus amateur log-probabilities over the expert's plausible tokens (an amateur model)",
                 '"Contrastive Decoding: Open-ended Text Generation as Optimization" (Li et al., 2023)'),
    StrategySpec("dola", DoLaConfig, _dola,
                 "final layer minus the most divergent premature layer (early exit), per token",
                 '"DoLa: Decoding by Contrasting Layers Improves Factuality in Large Language Models" '
                 '(Chuang et al., 2023)'),
    StrategySpec("adadec", AdaDecConfig, _adadec,
                 "greedy, pausing at high entropy to rerank the top tokens by a greedy lookahead",
                 '"Towards Better Code Generation: Adaptive Decoding with Uncertainty Guidance" (He et al., 2025)'),
)}

# ---------------------------------------------------------------------- look-back and superposed decoding
from .look_back import LookBack  # noqa: E402
from .superposed import NGramCounts, Superposed, check_weights, corpus_counts  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class LookBackConfig(StrategyConfig):
    strategy = "look-back"
    stochastic = True
    threshold: float = option(1.0, "alpha: an alarm where the current distribution's KL divergence to the closest "
                                   "earlier one (KL_min) is at most this (the paper tunes it in [0.5, 1.6])", low=0)
    top_k: int = option(5, "candidates at an alarm: the k most probable tokens, one sampled by softmax(-KL of its "
                           "next step to the prefix / temperature) (the paper: 5, 8 or 10; 1: greedy)",
                        low=1, high=MAX_BEAMS)
    window: int = option(128, "earlier positions (prompt and generated) whose distributions KL_min looks back on "
                              "(the paper's sliding window)", low=1, high=4096)
    prefix_window: int = option(256, "the prompt's last positions whose distributions form the prefix set of the "
                                     "coherence lookahead (the paper's prefixes are short: all of them)",
                                low=1, high=4096)
    num_return_sequences: int | None = _one_output()

    def pending_nodes(self, max_new_tokens: int) -> int:
        return self.top_k + 1


@dataclass(frozen=True, kw_only=True)
class SuperposedConfig(StrategyConfig):
    strategy = "superposed"
    num_drafts: int = option(3, "k: drafts grown from one pass of superposed embeddings", low=1, high=MAX_BEAMS)
    num_return_sequences: int | None = option(None, "drafts returned, best score first (None: all k)", low=1)
    alpha: float = option(0.54, "weight of the n-gram model's log-probability against the model's (0: no n-gram "
                                "model)", low=0, high=1)
    lm_temperature: float = option(0.06, "temperature of the model's distribution in the scores and the "
                                         "superposition weights (the authors' 0.06)", low=0, low_open=True, high=100)
    n_token_sample: int = option(9, "the model's most probable tokens each step considers", low=1, high=4096)
    ngram_weights: list | tuple = option((0.01, 0.04, 0.15, 0.18, 0.12), "interpolation weights of the 2-gram, 3-gram, ... "
                                                                 "models (1 to 6 numbers >= 0)")
    penalty: float = option(200.0, "subtracted from a draft's scores when no candidate has n-gram support", low=0)
    ngram_corpus: str | None = option(None, "a UTF-8 text file whose n-grams (in the model's tokens) the n-gram "
                                            "model counts besides the prompt's (None: the prompt only)")

    @property
    def width(self) -> int:
        return self.num_drafts

    def pending_nodes(self, max_new_tokens: int) -> int:
        return 2

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_weights(self.ngram_weights)
        except ValueError:
            raise InvalidParameterError(f"option 'ngram_weights' of strategy 'superposed' must list 1 to 6 numbers "
                                        f">= 0, got {self.ngram_weights!r}") from None
        if self.ngram_corpus is not None and not os.path.isfile(self.ngram_corpus):
            raise InvalidParameterError(f"option 'ngram_corpus' of strategy 'superposed': no file "
                                        f"{self.ngram_corpus!r}")
        _check_returns(self, self.num_drafts)


def _look_back(cfg: LookBackConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
               temperature: float, seed: int | None) -> TreeSearch:
    return LookBack(runner, prompt_ids, cfg, max_new_tokens, temperature=temperature, seed=seed)


def _superposed(cfg: SuperposedConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                temperature: float, seed: int | None) -> TreeSearch:
    decoder = runner.model.model
    if getattr(decoder, "backend", None) != "native":
        raise InvalidParameterError(f"strategy 'superposed' needs the native backend (it feeds superposed "
                                    f"embeddings); {runner.model.name} runs on {decoder.backend!r}")
    orders = tuple(range(1, len(cfg.ngram_weights) + 1))
    ngrams = [NGramCounts(orders).add(list(prompt_ids))]
    if cfg.ngram_corpus is not None and cfg.alpha > 0:
        ngrams.append(corpus_counts(runner, cfg.ngram_corpus, orders))
    return Superposed(runner, prompt_ids, cfg, max_new_tokens, ngrams=ngrams)


STRATEGIES.update({s.name: s for s in (
    StrategySpec("look-back", LookBackConfig, _look_back,
                 "greedy; where the distribution nears an earlier one (KL), a top-k token sampled by its next "
                 "step's closeness to the prefix",
                 '"Look-back Decoding for Open-Ended Text Generation" (Xu, Zhou, Celikyilmaz, Ma, 2023)'),
    StrategySpec("superposed", SuperposedConfig, _superposed,
                 "k drafts from one pass: the drafts' last-token embeddings superposed, n-gram-guided pruning",
                 '"Superposed Decoding: Multiple Generations from a Single Autoregressive Inference Pass" '
                 '(Shen et al., 2024)'),
)})

# test-time scaling: N samples in one batch on the shared prompt (strategies/parallel.py); these take a
# speculative method, the sampling filters and stop strings (``StrategyConfig.parallel``)
STRATEGIES.update({s.name: s for s in (
    StrategySpec("best-of-n", BestOfNConfig, _best_of_n,
                 "N samples in one batch, the best by a scorer (log-likelihood, a callable, or sandboxed unit tests)",
                 '"Training Verifiers to Solve Math Word Problems" (Cobbe et al., 2021) for best-of-N with a scorer'),
    StrategySpec("self-consistency", SelfConsistencyConfig, _self_consistency,
                 "N samples in one batch, the majority vote over their extracted answers",
                 '"Self-Consistency Improves Chain of Thought Reasoning in Language Models" (Wang et al., 2022; '
                 'ICLR 2023)'),
    StrategySpec("first-finish", FirstFinishConfig, _first_finish,
                 "N samples in one batch, the first to end (fewest decided tokens)",
                 '"First Finish Search: Efficient Test-Time Scaling in Large Language Models" (Agarwal et al., '
                 '2025)'),
    StrategySpec("speculative-rejection", SpeculativeRejectionConfig, _speculative_rejection,
                 "best-of-N that stops the lowest partial scores at checkpoints",
                 '"Fast Best-of-N Decoding via Speculative Rejection" (Sun et al., 2024)'),
)})

# ---------------------------------------------------------------------- step-level search guided by a scorer
from .a_star import AStarConfig, AStarDecoding  # noqa: E402
from .phi_decoding import PhiDecoding, PhiDecodingConfig  # noqa: E402


def _a_star(cfg: AStarConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
            temperature: float, seed: int | None) -> TreeSearch:
    return AStarDecoding(runner, prompt_ids, cfg, max_new_tokens, temperature=temperature, seed=seed)


def _phi_decoding(cfg: PhiDecodingConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                  temperature: float, seed: int | None) -> TreeSearch:
    return PhiDecoding(runner, prompt_ids, cfg, max_new_tokens, temperature=temperature, seed=seed)


STRATEGIES.update({s.name: s for s in (
    StrategySpec("a-star", AStarConfig, _a_star,
                 "best-first search over sampled steps: a priority queue by a process reward (a scorer), "
                 "the best partial solution expanded with k sampled next steps, within a token budget",
                 '"A*-Decoding: Token-Efficient Inference Scaling" (Chatziveroglou, 2025)'),
    StrategySpec("phi-decoding", PhiDecodingConfig, _phi_decoding,
                 "a step beam; each candidate step judged by a foresight rollout (advantage) and the clusters "
                 "of the rollouts, with in-width and in-depth pruning",
                 '"phi-Decoding: Adaptive Foresight Sampling for Balanced Inference-Time Exploration and '
                 'Exploitation" (Xu et al., 2025)'),
)})

# the shorthand keyword arguments / CLI flags, and the option each sets
SHORTHANDS = {"num_beams": "num_beams", "num_return_sequences": "num_return_sequences",
              "length_penalty": "length_penalty", "patience": "patience"}


def strategy_spec(strategy: str) -> StrategySpec:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise InvalidParameterError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)} "
                                    "(or none: greedy / sampling)")
    return STRATEGIES[strategy]


def strategy_config(strategy: "str | StrategyConfig", options: dict[str, Any] | None = None) -> StrategyConfig:
    """A validated config: from a strategy name and its options, or a config given as it is
    (``options`` then override its fields)."""
    if options is not None and not isinstance(options, dict):
        raise InvalidParameterError(f"strategy options must be a mapping of option names to values, "
                                    f"got {options!r:.80}")
    if isinstance(strategy, StrategyConfig):
        if options:
            return strategy.from_options({**strategy.as_dict(), **options})
        return strategy
    return strategy_spec(strategy).config.from_options(options)


def task_kind(strategy: StrategyConfig | None) -> "type[Task]":
    """The kind of task a request with this strategy runs (``core/task.py``), written here once:
    no strategy (None) is a plain ``Generation`` (``api.start_request`` builds it); a ``parallel``
    strategy (test-time scaling) is N ``ParallelSamples`` and any other a ``TreeSearch``
    (``build_search`` builds both).  The server asks the kind's ``kv_tokens`` for the KV cache to
    reserve before anything is built."""
    if strategy is None:
        return Generation
    return ParallelSamples if strategy.parallel else TreeSearch


def build_search(cfg: StrategyConfig, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None, *, sampling: Any = None, method: Any = None,
                 stop: list[str] | None = None) -> TreeSearch:
    """The search of a validated config (not started: its first ``step()`` acquires the cache).  A
    ``parallel`` strategy (test-time scaling) takes the ``SamplingParams`` (``sampling``), the method's
    config (``method``) and the stop strings of its samples."""
    spec = strategy_spec(cfg.strategy)
    if task_kind(cfg) is ParallelSamples:
        return spec.build(cfg, runner, prompt_ids, max_new_tokens, sampling=sampling, method=method, stop=stop)
    return spec.build(cfg, runner, prompt_ids, max_new_tokens, temperature, seed)


__all__ = ["STRATEGIES", "StrategySpec", "StrategyConfig", "BeamConfig", "DiverseBeamConfig",
           "BestFirstBeamConfig", "StochasticBeamConfig", "CPSBeamConfig", "ContrastiveSearchConfig",
           "ContrastiveConfig", "DoLaConfig", "AdaDecConfig", "LookBackConfig", "SuperposedConfig",
           "strategy_spec", "strategy_config",
           "task_kind", "build_search", "SHORTHANDS"]
