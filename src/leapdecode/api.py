"""The Python API: ``load``, ``generate``, ``stream``.

``generate(model, prompt, max_new_tokens=..., temperature=..., method="draft",
options={"top_k": 8})``: sampling parameters are keyword arguments (``SamplingParams``), a
method's own options go in ``options`` (validated against the method's typed config, see
``leapdecode.proposers.registry``), or ``method`` is a config object (``DraftConfig(top_k=8)``).
Everything is validated before any model work starts.

``strategy="beam"`` (or a config object, ``BeamConfig(num_beams=8)``) searches instead of decoding
one sequence: the strategy's options go in ``strategy_options``, or through the shorthands
``num_beams``, ``num_return_sequences``, ``length_penalty``, ``patience``; the result is a
``SearchResult`` (the best hypothesis, and ``hypotheses``: the n best with scores).  Strategies
live in ``leapdecode.strategies.registry``; a search runs with the vanilla method only (a
speculative ``method`` is refused: no drafting method combines with a search exactly today).  The
test-time scaling strategies (``best-of-n``, ``self-consistency``, ``first-finish``,
``speculative-rejection``) are N plain sampled generations in one batch: they take any ``method``
(each sample is exact in distribution), the sampling filters and ``stop``.

``model`` is what ``load()`` returned (its runner is found with ``runner_for``), or a
``ModelRunner`` (isolated state, e.g. a server's).

Diffusion LMs (issue 18, ``leapdecode.diffusion``): ``load`` of ``tiny-llada`` / ``tiny-dream`` or a
LLaDA/Dream checkpoint directory returns a ``DiffusionModel`` (``dtype``, ``device``, ``weights``:
fp32/bf16/int8/int4), and ``generate`` with a ``DiffusionModel`` (or such a name) runs
``leapdecode.diffusion.generate`` (``method``: a diffusion method, default ``stepwise``;
``options``, ``max_new_tokens``, ``block_size``, ``chat``, ``json_schema``/``regex``/``grammar``).
A causal method asked of a diffusion model, a diffusion method asked of a causal model, or a
sampling option a diffusion decoder does not take: ``InvalidParameterError``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from .core.config import MethodConfig
from .core.constraint import Constraint
from .core.generate import Generation, GenerationResult, check_max_new_tokens, check_stop, encode_prompt
from .core.kv_policy import KVPolicy, parse_kv_policy
from .core.runner import ModelRunner, runner_for
from .core.sampling import SamplingParams
from .errors import InvalidParameterError
from .models.loader import LoadedModel
from .models.loader import load as load_causal
from .proposers.registry import DEFAULT_METHOD, build_proposer, method_config
from .strategies.registry import SHORTHANDS, StrategyConfig, build_search, strategy_config
from .strategies.search import SearchResult, TreeSearch


def start_generation(
    model: LoadedModel | ModelRunner,
    prompt: Any = None,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    typical_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: str | list[str] | None = None,
    method: str | MethodConfig | None = None,
    options: dict[str, Any] | None = None,
    strategy: str | StrategyConfig | None = None,
    strategy_options: dict[str, Any] | None = None,
    num_beams: int | None = None,
    num_return_sequences: int | None = None,
    length_penalty: float | None = None,
    patience: float | None = None,
    chat: bool | None = None,
    prompt_ids: list[int] | None = None,
    kv_policy: str | KVPolicy | None = None,
    json_schema: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    constraint: Constraint | None = None,
) -> "Generation | TreeSearch":
    """A ``Generation`` (not started): validates every parameter, then builds the method's proposer
    (loading a draft model or datastore through the runner where the method needs one).  ``method``
    None: the default method (``"auto"``), or ``"vanilla"`` with a strategy.

    With ``strategy``: a ``TreeSearch`` (not started; the same ``run()``, iteration, ``cancel()``,
    ``close()`` and ``result`` as a ``Generation``) whose result is a ``SearchResult``; see the module
    docstring.  Deterministic strategies (beam, diverse-beam, best-first-beam) take no temperature;
    the stochastic ones (stochastic-beam, cps-beam) need ``temperature > 0`` and use ``seed``.  Other
    sampling filters, ``stop``, ``kv_policy`` and structured output do not combine with a strategy
    (an ``InvalidParameterError`` says so).

    Structured output (``leapdecode.strategies.grammar``, the ``structured`` extra): at most one of
    ``json_schema`` (a mapping or its JSON text; ``{"type": "object"}`` for any JSON object),
    ``regex`` or ``grammar`` (Lark, as llguidance reads it, or GBNF).  The output then follows it,
    with every method giving vanilla constrained decoding's tokens (greedy) or distribution.
    ``constraint`` passes one already compiled instead (``strategies.grammar.compile_constraint``;
    a server compiles while validating the request), used by this generation only.

    ``kv_policy``: lossy KV-cache compression for long generations (``core/kv_policy.py``), a
    spec string (``"streaming:sink=4,window=256"``, ``"h2o:budget=256,recent=32"``,
    ``"snapkv:budget=256"``, ``"scope:prefill=256,decode=128"``, ``"expected:budget=256"``,
    ``"int8"``) or a config object; None (the default): the exact, uncompressed cache."""
    if not isinstance(model, (LoadedModel, ModelRunner)):
        if is_diffusion(model):
            raise InvalidParameterError(f"{diffusion_label(model)} is a diffusion model: decode it with "
                                        "leapdecode.generate or leapdecode.diffusion.generate (no streaming)")
        raise InvalidParameterError(f"model must be what leapdecode.load() returned, got {type(model).__name__}")
    check_not_diffusion_method(method)
    params = SamplingParams(temperature, top_k, top_p, min_p, typical_p, repetition_penalty, seed)
    check_max_new_tokens(max_new_tokens)
    stops = check_stop(stop)
    shorthands = {"num_beams": num_beams, "num_return_sequences": num_return_sequences,
                  "length_penalty": length_penalty, "patience": patience}
    scfg = resolve_strategy(strategy, strategy_options, shorthands)
    if scfg is not None:
        if method is None:
            method = "vanilla"
        cfg = method_config(method, options)
        check_strategy_combination(scfg, cfg, params, stops, kv_policy,
                                   structured=any(v is not None for v in (json_schema, regex, grammar, constraint)))
    else:
        cfg = method_config(DEFAULT_METHOD if method is None else method, options)
    policy = parse_kv_policy(kv_policy)
    runner = runner_for(model)
    if policy is not None and runner.model.backend != "native":  # before any draft model loads
        raise InvalidParameterError(f"kv_policy needs the native backend ({runner.model.name} runs on "
                                    f"{runner.model.backend!r})")
    if prompt_ids is not None:
        if prompt is not None and prompt != "":  # probe PA33: the prompt was silently ignored
            raise InvalidParameterError("give a prompt or prompt_ids, not both")
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise InvalidParameterError("prompt_ids must be a list of token ids")
        vocab = runner.model.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParameterError(f"prompt_ids must be token ids in [0, {vocab})")
        ids = list(prompt_ids)
    else:
        ids = encode_prompt(runner.model, prompt, chat)
    # never more than the context can hold (the cache is sized from this)
    max_new_tokens = min(max_new_tokens, max(runner.model.max_seq_len - len(ids), 1))
    if scfg is not None:
        return build_search(scfg, runner, ids, max_new_tokens, temperature=params.temperature, seed=params.seed,
                            sampling=params, method=cfg, stop=stops)
    if json_schema is not None or regex is not None or grammar is not None:
        if constraint is not None:
            raise InvalidParameterError("give json_schema, regex or grammar, or a compiled constraint, not both")
        from .strategies.grammar import compile_constraint

        constraint = compile_constraint(runner, json_schema=json_schema, regex=regex, grammar=grammar)
    proposer = build_proposer(cfg, runner)
    return Generation(runner, ids, params, proposer, method=cfg.method, max_new_tokens=max_new_tokens,
                      stop=stops, tree_budget=cfg.tree_budget, kv_policy=policy, constraint=constraint)


def resolve_strategy(strategy: "str | StrategyConfig | None", options: dict[str, Any] | None,
                     shorthands: dict[str, Any]) -> StrategyConfig | None:
    """The validated strategy config of a call (None: no strategy): ``strategy`` with its
    ``options`` and the shorthand keyword arguments (``num_beams``, ...; None: not given), which
    must agree with ``options`` where both set an option."""
    given = {SHORTHANDS[k]: v for k, v in shorthands.items() if v is not None}
    if strategy is None:
        if options:
            raise InvalidParameterError("strategy_options need a strategy (strategy='beam', ...)")
        if given:
            raise InvalidParameterError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} a strategy "
                                        "(strategy='beam', ...)")
        return None
    if options is not None and not isinstance(options, dict):
        raise InvalidParameterError(f"strategy options must be a mapping of option names to values, got "
                                    f"{options!r:.80}")
    merged = dict(options or {})
    for key, value in given.items():
        if key in merged and merged[key] != value:
            raise InvalidParameterError(f"{key}={value!r} and strategy option {key}={merged[key]!r} disagree")
        merged[key] = value
    return strategy_config(strategy, merged or None)


def check_strategy_combination(scfg: StrategyConfig, cfg: MethodConfig, params: SamplingParams,
                               stop: list[str] | None, kv_policy: Any, structured: bool) -> None:
    """Refuse what does not combine with a search (``InvalidParameterError`` naming both)."""
    name = scfg.strategy
    if scfg.parallel:  # N plain sampled generations: any method, the filters, stop strings
        if params.temperature <= 0:
            raise InvalidParameterError(f"strategy {name!r} samples: give a temperature > 0")
        if kv_policy is not None:
            raise InvalidParameterError(f"strategy {name!r} does not combine with a kv_policy")
        if structured:
            raise InvalidParameterError(f"strategy {name!r} does not combine with structured output "
                                        "(json_schema, regex, grammar)")
        return
    if cfg.method != "vanilla":
        raise InvalidParameterError(
            f"strategy {name!r} does not combine with method {cfg.method!r}: a search scores every hypothesis "
            "with the target's own forwards (use method 'vanilla', the default with a strategy)")
    plain = (params.top_k, params.top_p, params.min_p, params.typical_p, params.repetition_penalty)
    if plain != (0, 1.0, 0.0, 1.0, 1.0):
        raise InvalidParameterError(f"strategy {name!r} does not combine with top_k, top_p, min_p, typical_p or "
                                    "repetition_penalty")
    if scfg.stochastic and params.temperature <= 0:
        raise InvalidParameterError(f"strategy {name!r} samples: give a temperature > 0")
    if not scfg.stochastic and params.temperature != 0:
        raise InvalidParameterError(f"strategy {name!r} is deterministic (it scores with the model's "
                                    f"log-probabilities): leave temperature at 0, got {params.temperature}")
    if stop:
        raise InvalidParameterError(f"strategy {name!r} does not combine with stop strings")
    if kv_policy is not None:
        raise InvalidParameterError(f"strategy {name!r} does not combine with a kv_policy")
    if structured:
        raise InvalidParameterError(f"strategy {name!r} does not combine with structured output "
                                    "(json_schema, regex, grammar)")


def generate(model: Any, prompt: Any = None, **kwargs: Any) -> GenerationResult:
    """Generate a continuation; see ``start_generation`` for the parameters.  With a ``strategy``,
    the result is a ``SearchResult`` (``.hypotheses``: the n best, each with its score).  With a
    diffusion model (a ``DiffusionModel`` or its name): ``generate_diffusion``."""
    if not isinstance(model, (LoadedModel, ModelRunner)) and is_diffusion(model):
        return generate_diffusion(model, prompt, **kwargs)
    return start_generation(model, prompt, **kwargs).run()


@functools.wraps(load_causal)
def load(name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(name_or_path, (str, os.PathLike)) and is_diffusion(name_or_path):
        if len(args) > 2:  # past dtype, device: the causal loader's positional backend, max_seq_len, ...
            raise InvalidParameterError("a diffusion model takes dtype and device positionally, weights= by keyword")
        return load_diffusion(name_or_path, *args, **kwargs)
    return load_causal(name_or_path, *args, **kwargs)


load.__doc__ = (load_causal.__doc__ or "") + """

A diffusion model's name (``tiny-llada``, ``tiny-dream``, a LLaDA/Dream checkpoint directory) loads a
``leapdecode.diffusion.DiffusionModel`` instead (``load_diffusion``)."""


def is_diffusion(model: Any) -> bool:
    """A ``DiffusionModel``, or the name of one (``tiny-llada``/``tiny-dream``, a LLaDA/Dream directory)."""
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        if not isinstance(text, str) or not (text.startswith(("tiny-llada", "tiny-dream"))
                                             or os.path.isfile(os.path.join(os.path.expanduser(text), "config.json"))):
            return False  # a causal model's name: leapdecode.diffusion is not imported
        from .diffusion.loaded import is_diffusion_name

        return is_diffusion_name(text)
    from .diffusion.loaded import DiffusionModel

    return isinstance(model, DiffusionModel)


def diffusion_label(model: Any) -> str:
    return repr(getattr(model, "name", None) or str(model))


DIFFUSION_DTYPES = {"auto": None, "fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def load_diffusion(name_or_path: Any, dtype: Any = "auto", device: Any = "auto", *, weights: str = "auto",
                   **rest: Any) -> Any:
    """``leapdecode.diffusion.load`` through ``leapdecode.load``'s parameters: ``dtype``
    (auto/fp32/bf16 or a torch dtype), ``device`` (auto: cpu), ``weights`` (auto: the dtype's
    float weights; fp32/bf16/int8/int4).  The causal-only parameters (``backend``, ...) must be
    left at their defaults."""
    import torch

    from .diffusion.api import load as diffusion_load

    given = [k for k, v in rest.items() if v not in (None, "auto")]
    if given:
        raise InvalidParameterError(f"{', '.join(given)}: not for a diffusion model ({diffusion_label(name_or_path)}); "
                                    "it takes dtype, device and weights")
    if isinstance(dtype, str):
        if dtype not in DIFFUSION_DTYPES:
            raise InvalidParameterError(f"dtype {dtype!r}: a diffusion model runs in fp32 or bf16 (or give weights=)")
        dtype = None if DIFFUSION_DTYPES[dtype] is None else getattr(torch, DIFFUSION_DTYPES[dtype])
    return diffusion_load(name_or_path, dtype=dtype, device="cpu" if device in (None, "auto") else device,
                          weights=None if weights in (None, "auto") else weights)


# keyword arguments of ``generate`` that a diffusion decoder does not take, with their defaults
DIFFUSION_UNSUPPORTED = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
                         "repetition_penalty": 1.0, "seed": None, "stop": None, "strategy": None,
                         "strategy_options": None, "num_beams": None, "num_return_sequences": None,
                         "length_penalty": None, "patience": None, "prompt_ids": None, "kv_policy": None,
                         "constraint": None}
DIFFUSION_KEYWORDS = ("method", "options", "max_new_tokens", "block_size", "chat", "json_schema", "regex", "grammar")


def generate_diffusion(model: Any, prompt: Any = None, **kwargs: Any) -> Any:
    """``leapdecode.generate`` of a diffusion model: ``leapdecode.diffusion.generate`` (a
    ``DiffusionResult``).  ``method`` None: ``stepwise``; a causal-LM method, or a sampling option
    (``temperature`` > 0, ``top_k``, ``stop``, a strategy...): ``InvalidParameterError``."""
    from .diffusion.api import generate as diffusion_generate

    bad = [k for k, v in kwargs.items() if k in DIFFUSION_UNSUPPORTED and v != DIFFUSION_UNSUPPORTED[k]]
    unknown = [k for k in kwargs if k not in DIFFUSION_UNSUPPORTED and k not in DIFFUSION_KEYWORDS]
    if unknown:
        raise InvalidParameterError(f"unknown keyword argument(s) {', '.join(unknown)}")
    if bad:
        raise InvalidParameterError(f"{', '.join(bad)}: not for a diffusion model ({diffusion_label(model)}); its "
                                    f"decoders are greedy and take {', '.join(DIFFUSION_KEYWORDS)}")
    args = {k: v for k, v in kwargs.items() if k in DIFFUSION_KEYWORDS and v is not None}
    args.setdefault("method", "stepwise")
    return diffusion_generate(model, prompt, **args)


def check_not_diffusion_method(method: Any) -> None:
    """A diffusion decoder's name asked of a causal model: ``InvalidParameterError``."""
    from .proposers.registry import METHODS

    if not isinstance(method, str) or method in METHODS:
        return
    from .diffusion.registry import DIFFUSION_METHODS

    if method in DIFFUSION_METHODS:
        raise InvalidParameterError(f"method {method!r} is a diffusion-LM method: it needs a LLaDA or Dream model "
                                    "(a checkpoint directory, tiny-llada, tiny-dream); a causal model decodes with "
                                    "a causal method (`leapdecode methods`)")


def stream(model: LoadedModel | ModelRunner, prompt: Any = None, **kwargs: Any) -> Generation:
    """Like ``generate`` but iterate for text pieces; ``.result`` is set at the end."""
    return start_generation(model, prompt, **kwargs)


__all__ = ["load", "generate", "stream", "start_generation", "Generation",
           "GenerationResult", "SearchResult", "ModelRunner", "runner_for"]
