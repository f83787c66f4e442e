"""Deprecated alias: ``leapdecode.heads_cli`` moved to ``leapdecode.training.cli`` (issue 48: heads training
in one package); this name goes in a later release."""

import warnings

from .training.cli import *  # noqa: F403 (the module's public names, under the old path)

warnings.warn("leapdecode.heads_cli moved to leapdecode.training.cli", DeprecationWarning, stacklevel=2)
