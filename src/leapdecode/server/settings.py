"""What ``leapdecode serve`` builds its app from (``ServeSettings``: the model, how to load it, and
the app's ``ServeConfig``), validated by the command line (``cli.py``) and picklable, so that a
Ray Serve replica (``ray_serve.py``) builds the very same app in its own process."""

from __future__ import annotations

from dataclasses import dataclass, field
from ..cli_args import LoadOptions
from .config import ServeConfig


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``leapdecode serve`` builds its app from, validated; picklable, so that each Ray
    Serve replica builds the very same app in its own process (``ray_serve.py``)."""

    model: str
    load: LoadOptions = field(default_factory=LoadOptions)  # how it loads: the model flags
    config: ServeConfig = field(default_factory=ServeConfig)  # create_app's
    warmup: bool = True
    threads: int | None = None  # torch.set_num_threads before loading (None: leave torch's choice)

    def build_app(self):
        """Load the model and build the app (and warm it up): what a server or a replica runs."""
        from ..api import generate
        from ..proposers.registry import build_proposer
        from .app import create_app

        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        model = self.load.load(self.model)
        app = create_app(model, self.config)
        if self.warmup:  # allocates the caches and builds the default method; fails here, not on a request
            generate(app.state.runner, "Hello", max_new_tokens=2, temperature=0.0, method=app.state.default_config)
        else:  # the default method is still built once, so that what every request needs (a draft) fails here
            build_proposer(app.state.default_config, app.state.runner)
        return app
