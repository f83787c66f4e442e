"""Errors a user can cause.  The CLI prints these as one line and exits with status 2."""


class LeapdecodeError(Exception):
    """Base class of errors caused by input: bad names, files, parameters, prompts."""


class UnknownModelError(LeapdecodeError):
    pass


class ModelFileError(LeapdecodeError):
    """A missing, corrupt or unreadable model file."""


class InvalidParameterError(LeapdecodeError, ValueError):
    """A parameter, or a combination of parameters, that is invalid.  ``field``: the request field
    at fault (``request.py``'s path: ``stop``, ``options.tree_budget``) where the request validator
    knows it; ``render(name)`` shows the message with a front end's names for the fields it names
    (this class's message names none; ``request.RequestError``'s may)."""

    field: str | None = None

    def render(self, name=None) -> str:  # noqa: ARG002 (a message without field references)
        return str(self)


class PromptTooLongError(LeapdecodeError):
    pass


class GrammarError(InvalidParameterError):
    """A JSON schema, regex or grammar that is invalid, unsupported by the grammar engine, or too
    costly to compile (structured output)."""


class MissingExtraError(LeapdecodeError):
    """A feature whose optional dependencies are not installed (the message names the extra)."""


class ScorerError(InvalidParameterError):
    """A scorer or answer extractor that cannot be used (test-time scaling strategies): an unknown
    name, a value that is not callable, a test scorer without tests, or a user callable that raised
    or returned something other than a finite number (an extractor: a string or None)."""


class HeadNotFoundError(LeapdecodeError):
    """A method that drafts with a trained head (medusa, eagle) asked for a target that has no head
    of that kind (the message names ``leapdecode train-head``)."""


class HeadMismatchError(LeapdecodeError):
    """A trained head whose manifest names another target model (or another kind of head)."""


class HeadFileError(ModelFileError):
    """A head directory whose manifest or weights are missing, corrupt or unreadable."""


class ExactnessError(LeapdecodeError):
    """``require_exact=True`` (``--require-exact``) on a configuration where speculative output is not
    guaranteed to be vanilla's bit for bit (the message names why: e.g. the kernel cannot build)."""
