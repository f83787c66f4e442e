"""OpenAI-compatible HTTP server: ``leapdecode serve`` (needs the ``server`` extra).

``from leapdecode.server.app import create_app`` builds the FastAPI app.  The modules:

* ``app.py``: ``create_app`` and the routes (short: they call the modules below);
* ``protocol.py``: request and response models (pydantic), the ``leapdecode`` extension;
* ``prepare.py``: the body size limit, then parsing, validation and tokenization off the event loop;
* ``engine.py``: the runner built at start-up, the worker thread, its bounded queue, typed events;
* ``respond.py``: JSON answers and server-sent event streams from a job's events;
* ``errors.py``: the table from exception type to HTTP status;
* ``config.py``: ``ServeConfig``, the one configuration; ``metrics.py``: Prometheus metrics; ``cli.py``: ``leapdecode serve``.

This module imports nothing heavy: the CLI reads the defaults below from it.
"""

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
# the byte budget of the cross-request memory every tenant's methods share (--memory-budget-mib)
DEFAULT_MEMORY_BUDGET_BYTES = 512 << 20
MEMORY_SCOPES = ("key", "user", "shared")  # --memory-scope: whose memory a request reads and feeds
# the largest structure (JSON schemas, tools' parameters, regex, grammar) a request may give, in bytes
# of its JSON text (--max-grammar-bytes), and the seconds its check and its compilation may each take
DEFAULT_MAX_GRAMMAR_BYTES = 256 << 10
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0
