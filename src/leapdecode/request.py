"""One generation request, validated once: ``GenerationRequest`` and ``validate_request``.

Every front end is an adapter over this module: the Python API's keyword arguments
(``api.start_generation``), the command line's flags (``cli_args.decoding_request``) and the
server's JSON (``server/protocol.py``) gather what the user gave under the request's field names,
then call ``validate_request``, which returns a frozen ``GenerationRequest`` or raises a
``RequestError``.  The rules that span fields (what a search combines with, one output structure
at most, a strategy's temperature, options that need their method) are written here and nowhere
else; the per-field checks are the typed configs' own (``SamplingParams``, the method and strategy
configs, ``parse_kv_policy``, ``check_json_schema``).

Field paths: ``max_new_tokens``; the sampling fields ``temperature``, ``top_k``, ``top_p``,
``min_p``, ``typical_p``, ``repetition_penalty``, ``seed``; ``stop``; ``method`` and
``options.NAME``; ``strategy`` and ``strategy_options.NAME``; ``kv_policy``; the output structure
``json_schema``, ``regex``, ``grammar`` or ``constraint`` (one compiled already).  A
``RequestError`` names its culprit's path (``field``) and keeps the fields its message mentions as
references (``Ref``), so that each front end shows the same words with its own names for them
(``render``; any ``InvalidParameterError`` renders, and carries ``field`` when the validator
raised it): ``--stop`` on the command line, ``stop`` on the server; ``--tree-budget`` or
``leapdecode.options.tree_budget``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .core.config import MethodConfig
from .core.constraint import Constraint
from .core.prompt import check_max_new_tokens, check_stop
from .core.kv_policy import KVPolicy, parse_kv_policy
from .core.sampling import SamplingParams
from .errors import InvalidParameterError
from .proposers.registry import DEFAULT_METHOD, METHODS, method_config, method_spec
from .strategies.registry import StrategyConfig, strategy_config, strategy_spec

# the sampling filters a tree search leaves at their neutral values (it scores with log-probabilities)
FILTERS = ("top_k", "top_p", "min_p", "typical_p", "repetition_penalty")


@dataclass(frozen=True)
class Ref:
    """A field named inside an error message; each front end renders it in its own words."""

    path: str


class RequestError(InvalidParameterError):
    """A request that does not validate on a rule of this module (the typed configs' own errors keep
    their types, with ``field`` set).  ``field``: the path of the culprit (``options.k``,
    ``stop``...); ``parts``: the message, text and ``Ref``s to the fields it names."""

    def __init__(self, field: str, *parts: str | Ref) -> None:
        self.field = field
        self.parts = parts
        super().__init__(self.render())

    def render(self, name: Callable[[str], str] | None = None) -> str:
        """The message with each referenced field shown as ``name(path)`` (default: the path)."""
        return "".join((name or str)(p.path) if isinstance(p, Ref) else p for p in self.parts)


@dataclass(frozen=True)
class RequestDefaults:
    """What a front end fills in where a request leaves a field out."""

    method: str = DEFAULT_METHOD
    options: Mapping[str, Any] = field(default_factory=dict)  # the default method's (``serve --option``)
    every_method: Mapping[str, Any] = field(default_factory=dict)  # any method with the option (``serve --draft``)
    temperature: float = 0.0  # when none is given (the server: OpenAI's 1); a deterministic search's is 0


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation request: everything but the prompt."""

    method: MethodConfig
    sampling: SamplingParams
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    strategy: StrategyConfig | None = None
    kv_policy: KVPolicy | None = None
    structure: Mapping[str, Any] | None = None  # ``compile_constraint``'s keywords (one of them), not compiled
    constraint: Constraint | None = None  # one compiled already (the server's, the API's ``constraint=``)
    # whose part of the runner's cross-request memory it uses: set by the server to the request's tenant
    memory_scope: str | None = None


UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()  # a field the request left out


def validate_request(*, max_new_tokens: Any = 256, temperature: Any = UNSET, top_k: Any = 0, top_p: Any = 1.0,
                     min_p: Any = 0.0, typical_p: Any = 1.0, repetition_penalty: Any = 1.0, seed: Any = None,
                     stop: Any = None, method: Any = None, options: Any = None, strategy: Any = None,
                     strategy_options: Any = None, kv_policy: Any = None, json_schema: Any = None,
                     regex: Any = None, grammar: Any = None, constraint: Constraint | None = None,
                     defaults: RequestDefaults = RequestDefaults()) -> GenerationRequest:
    """The request, or a ``RequestError`` naming the first field at fault.  ``method`` None: the
    default method (``defaults.method``), or vanilla with a strategy; ``temperature`` left out:
    ``defaults.temperature``, or 0 for a deterministic search."""
    check_method_name(method)
    scfg = _strategy(strategy, strategy_options)
    if temperature is UNSET:
        temperature = 0.0 if scfg is not None and not scfg.stochastic else defaults.temperature
    values = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                  repetition_penalty=repetition_penalty, seed=seed)
    for name, value in values.items():
        _field(name, SamplingParams, **{name: value})
    sampling = SamplingParams(**values)
    max_new_tokens = _field("max_new_tokens", check_max_new_tokens, max_new_tokens)
    stops = tuple(_field("stop", check_stop, stop))
    policy = _field("kv_policy", parse_kv_policy, kv_policy)
    structure = _structure(json_schema, regex, grammar, constraint)
    cfg = _method(method, options, scfg, defaults)
    if scfg is not None:
        _check_search(scfg, cfg, sampling, stops, policy, structure or constraint)
    return GenerationRequest(method=cfg, sampling=sampling, max_new_tokens=max_new_tokens, stop=stops,
                             strategy=scfg, kv_policy=policy, structure=structure, constraint=constraint)


def _field(path: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``check(...)``'s result; its ``InvalidParameterError`` (of whatever type) is raised with
    ``field`` set to ``path``."""
    try:
        return check(*args, **kwargs)
    except InvalidParameterError as e:
        if e.field is None:
            e.field = path
        raise


def _check_names(options: dict[str, Any], cls: Any, prefix: str) -> None:
    """Every option name is one of ``cls``'s (else a ``RequestError`` on the first unknown one)."""
    if not all(isinstance(k, str) for k in options):
        raise RequestError(prefix, f"option names of {cls.kind} {cls.config_name()!r} must be strings")
    unknown = sorted(k for k in options if k not in cls.option_names())
    if unknown:
        raise RequestError(f"{prefix}.{unknown[0]}", f"{cls.kind} {cls.config_name()!r} has no option "
                           f"{', '.join(map(repr, unknown))}; its options: {', '.join(cls.option_names())}")


def _culprit(cls: Any, options: Mapping[str, Any], prefix: str) -> str:
    """The path of the first option invalid on its own (``prefix``: none is, only their combination)."""
    for key, value in options.items():
        try:
            cls.from_options({key: value})
        except InvalidParameterError:
            return f"{prefix}.{key}"
    return prefix


def _strategy(strategy: Any, options: Any) -> StrategyConfig | None:
    if strategy is None:
        if options:
            raise RequestError("strategy_options", Ref("strategy_options"), " need a ", Ref("strategy"))
        return None
    if options is not None and not isinstance(options, Mapping):
        raise RequestError("strategy_options", f"strategy options must be a mapping of option names to values, "
                                               f"got {options!r:.80}")
    if isinstance(strategy, StrategyConfig):
        cls = type(strategy)
    else:
        cls = _field("strategy", strategy_spec, strategy).config
    options = dict(options or {})
    _check_names(options, cls, "strategy_options")
    try:
        return strategy_config(strategy, options or None)
    except InvalidParameterError as e:
        e.field = _culprit(cls, options, "strategy_options")
        raise


def _structure(json_schema: Any, regex: Any, grammar: Any, constraint: Any) -> dict[str, Any] | None:
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                               ("constraint", constraint)) if v is not None}
    if len(given) > 1:
        names = [Ref(k) for k in given]
        parts: list[str | Ref] = ["give at most one of "]
        for i, ref in enumerate(names):
            parts += [", " if 0 < i < len(names) - 1 else " and " if i else "", ref]
        raise RequestError(names[1].path, *parts, " (the output follows one structure)")
    if "json_schema" in given:
        from .constraints.grammar import check_json_schema

        return {"json_schema": _field("json_schema", check_json_schema, json_schema)}
    for key in ("regex", "grammar"):  # checked when compiled (the grammar engine's own words)
        if key in given:
            return {key: given[key]}
    if constraint is not None and not isinstance(constraint, Constraint):
        raise RequestError("constraint", f"constraint must be a compiled Constraint, got {type(constraint).__name__}")
    return None


def _method(method: Any, options: Any, scfg: StrategyConfig | None, defaults: RequestDefaults) -> MethodConfig:
    """The method's config: the front end's defaults, then the request's ``options``."""
    if options is not None and not isinstance(options, Mapping):
        raise RequestError("options", f"options must be a mapping of option names to values, got {options!r:.80}")
    explicit = dict(options or {})
    if scfg is not None and explicit and (method is None or not scfg.parallel):
        key = next(iter(explicit))
        if method is None and scfg.parallel:
            raise RequestError(f"options.{key}", f"strategy {scfg.strategy!r} samples with method 'vanilla' unless "
                               "a ", Ref("method"), " is given: ", Ref(f"options.{key}"), " needs one")
        raise RequestError(f"options.{key}", f"strategy {scfg.strategy!r} does not combine with ",
                           Ref(f"options.{key}"), " (a search scores every hypothesis with the target's own "
                           "forwards, method 'vanilla')")
    name = method if method is not None else ("vanilla" if scfg is not None else defaults.method)
    if isinstance(name, MethodConfig):
        cls = type(name)
        base = {}
    else:
        cls = _field("method", method_spec, name).config
        base = {k: v for k, v in defaults.every_method.items() if k in cls.option_names()}
        if name == defaults.method:
            base.update(defaults.options)
    _check_names(explicit, cls, "options")
    try:
        return method_config(name, {**base, **explicit} or None)
    except InvalidParameterError as e:
        e.field = _culprit(cls, explicit, "options")
        raise


def _check_search(scfg: StrategyConfig, cfg: MethodConfig, sampling: SamplingParams, stops: tuple[str, ...],
                  policy: KVPolicy | None, structure: Any) -> None:
    """What a strategy does not combine with (``RequestError`` naming the field)."""
    name = scfg.strategy
    refused: list[str] = []
    if policy is not None:
        refused.append("kv_policy")
    if structure:
        refused.append(next(iter(structure)) if isinstance(structure, Mapping) else "constraint")
    if not scfg.parallel:
        if cfg.method != "vanilla":
            raise RequestError("method", f"strategy {name!r} does not combine with method {cfg.method!r}: a search "
                               "scores every hypothesis with the target's own forwards (leave the ", Ref("method"),
                               " out, or 'vanilla')")
        defaults = SamplingParams()
        refused = [f for f in FILTERS if getattr(sampling, f) != getattr(defaults, f)] + (["stop"] if stops else []) \
            + refused
    if refused:
        raise RequestError(refused[0], f"strategy {name!r} does not combine with ", Ref(refused[0]))
    if scfg.stochastic and sampling.temperature <= 0:
        raise RequestError("temperature", f"strategy {name!r} samples: give a ", Ref("temperature"), " > 0")
    if not scfg.stochastic and sampling.temperature != 0:
        raise RequestError("temperature", f"strategy {name!r} is deterministic (it scores with the model's "
                           "log-probabilities): leave the ", Ref("temperature"), f" at 0, got {sampling.temperature}")


def check_method_name(method: Any) -> None:
    """A diffusion decoder's name asked of a causal model: a ``RequestError`` on ``method``."""
    if not isinstance(method, str) or method in METHODS:
        return
    from .diffusion.registry import DIFFUSION_METHODS

    if method in DIFFUSION_METHODS:
        raise RequestError("method", f"method {method!r} is a diffusion-LM method: it needs a LLaDA or Dream model "
                                     "(a checkpoint directory, tiny-llada, tiny-dream); a causal model decodes with "
                                     "a causal method (`leapdecode methods`)")


# What a diffusion model's decoders (greedy, over a canvas) do not take: each request field, with the
# value that leaves it unset; and the fields they do take.  Every front end checks its diffusion
# requests with ``check_diffusion_fields`` (the API's keyword arguments, the CLI's flags).
DIFFUSION_UNSUPPORTED: Mapping[str, Any] = {
    "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repetition_penalty": 1.0,
    "seed": None, "stop": None, "kv_policy": None, "strategy": None, "strategy_options": None, "num_beams": None,
    "num_return_sequences": None, "length_penalty": None, "patience": None, "grammar_aligned": None,
    "options.draft": None, "options.tree_budget": None, "options.datastore": None,
}
DIFFUSION_FIELDS = ("method", "options", "max_new_tokens", "block_size", "chat", "json_schema", "regex", "grammar")


def check_diffusion_fields(given: Mapping[str, Any], model: str) -> None:
    """A ``RequestError`` naming every field of ``given`` (request paths -> values) that a diffusion
    model's decoders do not take and that is set; ``model``: the model, as the message names it."""
    bad = [k for k, v in given.items() if k in DIFFUSION_UNSUPPORTED and v != DIFFUSION_UNSUPPORTED[k]]
    if bad:
        raise RequestError(bad[0], *_listed(bad), f": not for a diffusion model ({model}); its decoders are greedy "
                           "and take ", *_listed(DIFFUSION_FIELDS))


def _listed(paths: Sequence[str]) -> list[str | Ref]:
    """``paths`` as references separated by commas."""
    out: list[str | Ref] = []
    for path in paths:
        out += [", ", Ref(path)] if out else [Ref(path)]
    return out


__all__ = ["DIFFUSION_FIELDS", "DIFFUSION_UNSUPPORTED", "GenerationRequest", "RequestDefaults", "RequestError", "Ref",
           "UNSET", "check_diffusion_fields", "validate_request"]
