"""Errors a user can cause.  The CLI prints these as one line and exits with status 2."""


class LeapdecodeError(Exception):
    """Base class of errors caused by input: bad names, files, parameters, prompts."""


class UnknownModelError(LeapdecodeError):
    pass


class ModelFileError(LeapdecodeError):
    """A missing, corrupt or unreadable model file."""


class InvalidParameterError(LeapdecodeError, ValueError):
    pass


class PromptTooLongError(LeapdecodeError):
    pass
