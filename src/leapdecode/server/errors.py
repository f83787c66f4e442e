"""From an exception to an HTTP answer: one table, by exception type (never by message text).

A client's mistake is a 4xx whose message (and OpenAI ``param``) names the field; anything
the table does not list is an internal fault: a 500 whose message carries an error id, and the
server log has the traceback under that id.  Errors are OpenAI error objects
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ..errors import LeapdecodeError, PromptTooLongError, UnknownModelError
from .exceptions import EngineStopped, QueueFullError, RequestTooLargeError
from .protocol import ErrorBody, ErrorResponse, LeapdecodeExtension


log = logging.getLogger("leapdecode.server")


class ApiError(Exception):
    """An answer decided by the server itself (bad API key, unknown model, ...)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class RequestTimeout(Exception):
    def __init__(self, timeout: float) -> None:
        super().__init__(f"the request did not finish within the server's request timeout of {timeout:g} s "
                         "(--request-timeout); its generation was cancelled")


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-body-bytes)")
        self.limit = limit


class BodyTimeout(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g} s")
        self.seconds = seconds


# ---------------------------------------------------------------------------- pydantic errors
FRIENDLY = {  # pydantic error type -> message after the field name
    "model_type": "must be an object",
    "dict_type": "must be an object",
    "model_attributes_type": "must be an object",
    "list_type": "must be an array",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "bool_type": "must be a boolean",
    "literal_error": "has an unsupported value",
}


def field_path(loc: tuple) -> str | None:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def describe_validation_error(e: ValidationError) -> tuple[str, str | None, str | None]:
    """(message, param, code) of the first error."""
    err = e.errors(include_url=False)[0]
    kind, ctx = err["type"], err.get("ctx") or {}
    param = ctx.get("param") or field_path(err["loc"])
    code = ctx.get("code")
    if kind == "ld_verbatim":
        message = err["msg"]
    elif kind in ("ld_field", "unsupported_parameter"):
        message = f"{param} {err['msg']}" if param else err["msg"]
        code = code or ("unsupported_parameter" if kind == "unsupported_parameter" else None)
    elif kind == "missing":
        message, code = f"you must provide a {param} parameter", "missing_required_parameter"
    elif kind == "extra_forbidden":
        message = f"unknown field {param}"
        if err["loc"][:1] == ("leapdecode",):
            message += f"; leapdecode fields: {', '.join(LeapdecodeExtension.model_fields)}"
    else:
        message = f"{param} {FRIENDLY[kind]}" if kind in FRIENDLY and param else f"{param}: {err['msg']}"
    return message, param, code


# ---------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Rule:
    status: int
    type: str
    code: str | None = None
    describe: Callable[[Any], tuple[str, str | None, str | None]] | None = None  # -> (message, param, code)
    headers: Callable[[Any], dict[str, str]] | None = None


STATUS_TABLE: tuple[tuple[type[BaseException], Rule], ...] = (  # the first matching type wins
    (ValidationError, Rule(400, "invalid_request_error", describe=describe_validation_error)),
    (PromptTooLongError, Rule(400, "invalid_request_error", "context_length_exceeded")),
    (UnknownModelError, Rule(400, "invalid_request_error", "model_not_found")),
    (RequestTooLargeError, Rule(400, "invalid_request_error", "kv_cache_budget_exceeded")),
    (LeapdecodeError, Rule(400, "invalid_request_error")),
    (BodyTooLarge, Rule(413, "invalid_request_error", "request_too_large")),
    (BodyTimeout, Rule(408, "invalid_request_error", "request_timeout")),
    # the client left while sending its body (probe HX06): no answer reaches it, and it is no fault of ours
    (ClientDisconnect, Rule(499, "invalid_request_error", "client_closed_request")),
    (QueueFullError, Rule(429, "rate_limit_error", "queue_full",
                          headers=lambda e: {"Retry-After": str(e.retry_after)})),
    (EngineStopped, Rule(503, "server_error", "shutting_down")),
    (RequestTimeout, Rule(504, "timeout_error", "request_timeout")),
)


def rule_for(exc: BaseException) -> Rule | None:
    return next((rule for cls, rule in STATUS_TABLE if isinstance(exc, cls)), None)


def report_internal(exc: BaseException) -> str | None:
    """For an internal fault (not in the table): log its traceback under a new error id and return
    the id; ``None`` for an error the table lists."""
    if isinstance(exc, ApiError) or rule_for(exc) is not None:
        return None
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s: %s: %s", error_id, type(exc).__name__, exc,
              exc_info=(type(exc), exc, exc.__traceback__))
    return error_id


def api_error(exc: BaseException, error_id: str | None = None) -> ApiError:
    """The HTTP answer to ``exc``.  ``error_id``: the fault was logged already under this id."""
    if isinstance(exc, ApiError):
        return exc
    rule = rule_for(exc)
    if rule is None:
        error_id = error_id or report_internal(exc)
        return ApiError(500, f"internal server error (error id {error_id}; the server log has the details)",
                        type="server_error", code="internal_error", headers={"X-Error-Id": str(error_id)})
    message, param, code = rule.describe(exc) if rule.describe else (str(exc), None, None)
    return ApiError(rule.status, message, type=rule.type, param=param, code=code or rule.code,
                    headers=rule.headers(exc) if rule.headers else None)
