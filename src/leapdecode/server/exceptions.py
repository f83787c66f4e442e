"""Exceptions of the server's engine (below both the engine and the status table, which maps
them to 400, 429 and 503)."""


class QueueFullError(Exception):
    def __init__(self, retry_after: int, max_queue: int) -> None:
        super().__init__(f"the server is busy ({max_queue} requests waiting); retry after {retry_after} s")
        self.retry_after = retry_after


class EngineStopped(Exception):
    """The server is shutting down."""


class RequestTooLargeError(Exception):
    """The request could never fit the engine's KV-cache budget (400)."""
