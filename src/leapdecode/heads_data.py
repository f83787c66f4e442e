"""Deprecated alias: ``leapdecode.heads_data`` moved to ``leapdecode.training.data`` (issue 48: heads training
in one package); this name goes in a later release."""

import warnings

from .training.data import *  # noqa: F403 (the module's public names, under the old path)

warnings.warn("leapdecode.heads_data moved to leapdecode.training.data", DeprecationWarning, stacklevel=2)
