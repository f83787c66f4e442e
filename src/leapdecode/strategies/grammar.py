"""Deprecated alias: ``leapdecode.strategies.grammar`` moved to ``leapdecode.constraints.grammar`` (issue 48:
constrained decoding is its own package below the strategies); this name goes in a later release."""

import warnings

from ..constraints.grammar import *  # noqa: F403 (the module's public names, under the old path)

warnings.warn("leapdecode.strategies.grammar moved to leapdecode.constraints.grammar", DeprecationWarning, stacklevel=2)
