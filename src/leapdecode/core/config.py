"""Typed method configs: one frozen dataclass per decoding method, validated on construction.

A method's options are the fields of its config (``DraftConfig``, ``PldConfig``, ...), declared
with ``option()``: a default, a help text and bounds.  The same fields build the CLI's
``--option KEY=VALUE``, the server's ``leapdecode.options`` object and the option tables of
docs/methods.md, so the three cannot drift apart.  Every config also carries ``tree_budget``
(the most drafted nodes verified per step; ``None``: the method's own default).

Validation happens when a config is built (``MethodConfig.from_options``), before any model
loads: an unknown option or a value of the wrong type or out of range is an
``InvalidParameterError`` that names the option and the method.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import InvalidParameterError


def option(default: Any, help: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, choices: tuple | None = None, server_max: Any = None) -> Any:
    """A config field with its help text and bounds (``low``/``high`` inclusive unless ``low_open``).

    ``server_max``: for an option that sizes shared or long-lived state, or a step's work (a memory's
    size, a trie's depth, a window, a tree), the most a server's request may ask for unless the
    operator raises it (``leapdecode serve --request-limit METHOD.OPTION=N``; ``False`` for a switch
    a request may not turn on); ``request_limits`` gathers them.  The API and the CLI, whose user owns
    the process, are not bounded by it."""
    return field(default=default, metadata={"help": help, "low": low, "high": high, "low_open": low_open,
                                            "choices": choices, "server_max": server_max})


def _allowed_types(annotation: Any) -> tuple[tuple[type, ...], bool]:
    """(the concrete types an annotation admits, whether None is admitted)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        concrete: tuple[type, ...] = ()
        for a in args:
            if a is not type(None):
                concrete += _allowed_types(a)[0]
        return concrete, type(None) in args
    if origin is not None:
        return (origin,), False
    if annotation is Any:
        return (object,), True
    return (annotation,), False


def _describe(types_: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    return " or ".join(names.get(t, t.__name__) for t in types_)


@dataclass(frozen=True, kw_only=True)
class OptionsConfig:
    """Base of typed option sets (a decoding method's, a decoding strategy's): ``option()`` fields,
    validated on construction.  Subclasses say what they configure (``kind``: "method",
    "strategy") and name it (``config_name()``); messages read "option 'k' of method 'draft'"."""

    kind: ClassVar[str] = "method"

    @classmethod
    def config_name(cls) -> str:
        return getattr(cls, "method", cls.__name__)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            self._check(f, hints[f.name], getattr(self, f.name))

    def _check(self, f: dataclasses.Field, annotation: Any, value: Any) -> None:
        where = f"option {f.name!r} of {self.kind} {self.config_name()!r}"
        allowed, nullable = _allowed_types(annotation)
        if value is None:
            if not nullable:
                raise InvalidParameterError(f"{where} must be {_describe(allowed)}, got None")
            return
        ok = isinstance(value, allowed)
        if isinstance(value, bool) and bool not in allowed:
            ok = False  # True is not the integer 1 here
        if not ok and float in allowed and isinstance(value, int) and not isinstance(value, bool):
            ok = True  # an integer is a fine number
        if not ok:
            raise InvalidParameterError(f"{where} must be {_describe(allowed)}, got {value!r}")
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            raise InvalidParameterError(f"{where} must be finite, got {value!r}")
        meta = f.metadata
        choices = meta.get("choices")
        if choices is not None and value not in choices:
            raise InvalidParameterError(f"{where} must be one of {', '.join(map(str, choices))}, got {value!r}")
        low, high = meta.get("low"), meta.get("high")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if low is not None and (value <= low if meta.get("low_open") else value < low):
                raise InvalidParameterError(f"{where} must be {'>' if meta.get('low_open') else '>='} {low}, "
                                            f"got {value!r}")
            if high is not None and value > high:
                raise InvalidParameterError(f"{where} must be <= {high}, got {value!r}")

    # ------------------------------------------------------------ construction
    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: dict[str, Any] | None = None) -> "OptionsConfig":
        """Build from a plain mapping, naming any unknown option and the method."""
        options = dict(options or {})
        if not all(isinstance(k, str) for k in options):
            raise InvalidParameterError(f"option names of {cls.kind} {cls.config_name()!r} must be strings")
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise InvalidParameterError(
                f"{cls.kind} {cls.config_name()!r} has no option {', '.join(map(repr, unknown))}; "
                f"its options: {', '.join(cls.option_names())}")
        return cls(**options)

    @classmethod
    def parse_option(cls, key: str, text: str) -> Any:
        """Turn the text of a CLI ``--option KEY=VALUE`` into the field's type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if key not in fields:
            raise InvalidParameterError(
                f"{cls.kind} {cls.config_name()!r} has no option {key!r}; its options: {', '.join(cls.option_names())}")
        allowed, nullable = _allowed_types(typing.get_type_hints(cls)[key])
        if nullable and text.lower() in ("none", "null", ""):
            return None
        for t in allowed:
            if t is bool:
                if text.lower() in ("true", "yes", "on", "1"):
                    return True
                if text.lower() in ("false", "no", "off", "0"):
                    return False
            elif t is int:
                try:
                    return int(text)
                except ValueError:
                    pass
            elif t is float:
                try:
                    return float(text)
                except ValueError:
                    pass
            elif t is list:
                try:
                    value = json.loads(text)
                except ValueError:
                    continue
                if isinstance(value, list):
                    return value
            elif t is str or t is object:
                return text
        raise InvalidParameterError(
            f"option {key!r} of {cls.kind} {cls.config_name()!r} must be {_describe(allowed)}, got {text!r}")

    def replace(self, **changes: Any) -> "OptionsConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def server_limits(cls) -> dict[str, Any]:
        """``{option: server_max}`` of the options a server bounds in requests (``option()``)."""
        return {f.name: f.metadata["server_max"] for f in dataclasses.fields(cls)
                if f.metadata.get("server_max") is not None}

    @classmethod
    def options_table(cls) -> list[tuple[str, str, str]]:
        """(name, default, help) per option, for docs and ``--help``."""
        rows = []
        for f in dataclasses.fields(cls):
            help_, bound = f.metadata.get("help", ""), f.metadata.get("server_max")
            if bound is not None:  # what ``leapdecode serve --request-limit`` overrides
                help_ += " (a server's request: " + ("may not turn it on)" if bound is False else f"at most {bound})")
            rows.append((f.name, repr(f.default), help_))
        return rows


@dataclass(frozen=True, kw_only=True)
class MethodConfig(OptionsConfig):
    """Base of every method's config.  Subclasses set ``method`` and add ``option()`` fields."""

    method: ClassVar[str] = "base"
    tree_budget: int | None = option(None, "most drafted nodes verified per step (default: the method's own)",
                                     low=1, server_max=64)
    # the budget drafted when ``tree_budget`` is None: a number (the proposer reads it from here), or
    # how the proposer derives it; ``leapdecode methods`` shows it as ``tree_budget``'s default
    default_tree_budget: ClassVar[int | str] = 24

    @classmethod
    def tree_budget_default_text(cls) -> str:
        return str(cls.default_tree_budget)

    @classmethod
    def options_table(cls) -> list[tuple[str, str, str]]:
        return [(name, cls.tree_budget_default_text() if name == "tree_budget" else default, help_)
                for name, default, help_ in super().options_table()]


def parse_option_assignments(config_cls: type[OptionsConfig], items: list[str] | None,
                             flag: str = "--option") -> dict[str, Any]:
    """``["k=3", "beam=2"]`` (CLI ``--option``, or the ``flag`` named) -> typed values for ``config_cls``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidParameterError(f"{flag} takes KEY=VALUE, got {item!r}")  # probe G039: the flag given
        out[key] = config_cls.parse_option(key, text.strip())
    return out
