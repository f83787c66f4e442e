"""Deprecated alias: ``leapdecode.strategies.asap`` moved to ``leapdecode.constraints.asap`` (issue 48:
constrained decoding is its own package below the strategies); this name goes in a later release."""

import warnings

from ..constraints.asap import *  # noqa: F403 (the module's public names, under the old path)

warnings.warn("leapdecode.strategies.asap moved to leapdecode.constraints.asap", DeprecationWarning, stacklevel=2)
