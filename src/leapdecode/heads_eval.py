"""Deprecated alias: ``leapdecode.heads_eval`` moved to ``leapdecode.training.accuracy`` (issue 48: heads training
in one package); this name goes in a later release."""

import warnings

from .training.accuracy import *  # noqa: F403 (the module's public names, under the old path)

warnings.warn("leapdecode.heads_eval moved to leapdecode.training.accuracy", DeprecationWarning, stacklevel=2)
