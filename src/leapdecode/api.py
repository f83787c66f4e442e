"""The Python API: ``load``, ``generate``, ``stream``.

``generate(model, prompt, max_new_tokens=..., temperature=..., method="draft",
options={"top_k": 8})``: sampling parameters are keyword arguments (``SamplingParams``), a
method's own options go in ``options`` (validated against the method's typed config, see
``leapdecode.proposers.registry``), or ``method`` is a config object (``DraftConfig(top_k=8)``).
Everything is validated before any model work starts, by the one request validator every front end
shares (``leapdecode.request.validate_request``); ``start_request(model, request, prompt)`` starts a
``GenerationRequest`` validated already (what the command line and the server do).

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
from .core.generate import Generation, GenerationResult
from .core.prompt import encode_prompt
from .core.kv_policy import KVPolicy
from .core.runner import ModelRunner, runner_for
from .errors import InvalidParameterError
from .models.loader import LoadedModel
from .models.loader import load as load_causal
from .proposers.registry import build_proposer
from .request import (DIFFUSION_FIELDS, DIFFUSION_UNSUPPORTED, GenerationRequest, check_diffusion_fields,
                      check_method_name, validate_request)
from .strategies.registry import SHORTHANDS, StrategyConfig, build_search, task_kind
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

    Structured output (``leapdecode.constraints.grammar``, the ``structured`` extra): at most one of
    ``json_schema`` (a mapping or its JSON text; ``{"type": "object"}`` for any JSON object),
    ``regex`` or ``grammar`` (Lark, as llguidance reads it, or GBNF).  The output then follows it,
    with every method giving vanilla constrained decoding's tokens (greedy) or distribution.
    ``constraint`` passes one already compiled instead (``constraints.grammar.compile_constraint``;
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
    shorthands = {"num_beams": num_beams, "num_return_sequences": num_return_sequences,
                  "length_penalty": length_penalty, "patience": patience}
    request = validate_request(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        typical_p=typical_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, method=method,
        options=options, strategy=strategy, strategy_options=merge_shorthands(strategy, strategy_options, shorthands),
        kv_policy=kv_policy, json_schema=json_schema, regex=regex, grammar=grammar, constraint=constraint)
    return start_request(model, request, prompt, prompt_ids=prompt_ids, chat=chat)


def start_request(model: LoadedModel | ModelRunner, request: GenerationRequest, prompt: Any = None, *,
                  prompt_ids: list[int] | None = None, chat: bool | None = None) -> "Generation | TreeSearch":
    """The generation (or search) of a validated request (``request.validate_request``), not
    started: the prompt is encoded (or ``prompt_ids`` checked), ``max_new_tokens`` capped at the
    context, a structure compiled, the method's proposer built (loading what it needs)."""
    runner = runner_for(model)
    if request.kv_policy is not None and runner.model.backend != "native":  # before any draft model loads
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
    max_new_tokens = min(request.max_new_tokens, max(runner.model.max_seq_len - len(ids), 1))
    params, stops = request.sampling, list(request.stop)
    if task_kind(request.strategy) is not Generation:  # a search or N parallel samples
        search = build_search(request.strategy, runner, ids, max_new_tokens, temperature=params.temperature,
                              seed=params.seed, sampling=params, method=request.method, stop=stops)
        search.memory_scope = request.memory_scope
        return search
    constraint = request.constraint
    if request.structure:
        from .constraints.grammar import compile_constraint

        constraint = compile_constraint(runner, **request.structure)
    proposer = build_proposer(request.method, runner)
    return Generation(runner, ids, params, proposer, method=request.method.method, max_new_tokens=max_new_tokens,
                      stop=stops, tree_budget=request.method.tree_budget, kv_policy=request.kv_policy,
                      constraint=constraint, memory_scope=request.memory_scope)


def merge_shorthands(strategy: Any, options: Any, shorthands: dict[str, Any]) -> Any:
    """``strategy_options`` with the API's shorthand keywords (``num_beams``, ...; None: not given)
    merged in; they need a strategy and must agree with ``strategy_options`` where both set one."""
    given = {SHORTHANDS[k]: v for k, v in shorthands.items() if v is not None}
    if not given:
        return options
    if strategy is None:
        raise InvalidParameterError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} a strategy "
                                    "(strategy='beam', ...)")
    if options is not None and not isinstance(options, dict):
        return options  # the validator names it
    merged = dict(options or {})
    for key, value in given.items():
        if key in merged and merged[key] != value:
            raise InvalidParameterError(f"{key}={value!r} and strategy option {key}={merged[key]!r} disagree")
        merged[key] = value
    return merged


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


def generate_diffusion(model: Any, prompt: Any = None, **kwargs: Any) -> Any:
    """``leapdecode.generate`` of a diffusion model: ``leapdecode.diffusion.generate`` (a
    ``DiffusionResult``).  ``method`` None: ``stepwise``; a causal-LM method, or a sampling option
    (``temperature`` > 0, ``top_k``, ``stop``, a strategy...): ``InvalidParameterError``
    (``request.check_diffusion_fields``, the rule every front end applies)."""
    from .diffusion.api import generate as diffusion_generate

    causal_only = ("prompt_ids", "constraint")  # this API's own arguments a diffusion decoder lacks
    unknown = [k for k in kwargs if k not in DIFFUSION_UNSUPPORTED and k not in DIFFUSION_FIELDS
               and k not in causal_only]
    if unknown:
        raise InvalidParameterError(f"unknown keyword argument(s) {', '.join(unknown)}")
    given = [k for k in causal_only if kwargs.get(k) is not None]
    if given:
        raise InvalidParameterError(f"{', '.join(given)}: not for a diffusion model ({diffusion_label(model)})")
    check_diffusion_fields(kwargs, diffusion_label(model))
    args = {k: v for k, v in kwargs.items() if k in DIFFUSION_FIELDS and v is not None}
    args.setdefault("method", "stepwise")
    return diffusion_generate(model, prompt, **args)


check_not_diffusion_method = check_method_name  # the request validator's check, by its old name


def stream(model: LoadedModel | ModelRunner, prompt: Any = None, **kwargs: Any) -> "Generation | TreeSearch":
    """Like ``generate``, but an iterator of text pieces as they are decided (``next()`` runs steps
    until one decides text); ``.result`` is set at the end.  ``close()``, or leaving a ``with``
    block, ends it early and gives its KV cache back (as a file object's ``close``); a stream no
    longer referenced gives it back when it is collected.  With a ``strategy``, the best
    hypothesis's text comes once, at the end."""
    return start_generation(model, prompt, **kwargs)


__all__ = ["load", "generate", "stream", "start_generation", "start_request", "GenerationRequest", "Generation",
           "GenerationResult", "SearchResult", "ModelRunner", "runner_for"]
