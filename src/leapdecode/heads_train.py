"""Deprecated alias: ``leapdecode.heads_train`` moved to ``leapdecode.training.train`` (issue 48: heads training
in one package); this name goes in a later release."""

import warnings

from .training.train import *  # noqa: F403 (the module's public names, under the old path)

warnings.warn("leapdecode.heads_train moved to leapdecode.training.train", DeprecationWarning, stacklevel=2)
