"""Proposers: one file per drafting method; ``registry.py`` maps a method name to its typed config
and to what builds its proposer."""

from .registry import DEFAULT_METHOD, METHODS, MethodSpec, build_proposer, method_config, method_spec

__all__ = ["DEFAULT_METHOD", "METHODS", "MethodSpec", "build_proposer", "method_config", "method_spec"]
