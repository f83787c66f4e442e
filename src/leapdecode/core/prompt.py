"""The prompt and the request's text checks, for every front end: a string or chat messages turned
into token ids (the model's chat template, tools), and the checks of ``max_new_tokens``, stop
strings and text that is not UTF-8.  Errors are ``InvalidParameterError`` (``ModelFileError`` for a
broken chat template) naming what is wrong."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from ..errors import InvalidParameterError, ModelFileError, PromptTooLongError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # every front end's (the server's too)


def _check_message(m: Any, i: int) -> None:
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise InvalidParameterError(f"message {i} must be a {{'role': ..., 'content': ...}} mapping, got {m!r:.80}")
    if m["role"] not in CHAT_ROLES:  # probe PA29: an unknown role went into the template
        raise InvalidParameterError(f"message {i}: 'role' must be one of {', '.join(CHAT_ROLES)}, "
                                    f"got {m['role']!r:.80}")
    if not isinstance(m["content"], str):
        raise InvalidParameterError(f"message {i}: 'content' must be a string, got {type(m['content']).__name__}")


def check_text(text: str, what: str) -> str:
    """``text`` if it can be encoded as UTF-8; an ``InvalidParameterError`` naming ``what`` and the
    position for a lone surrogate (a JSON ``"\ud800"``, or bytes that are not UTF-8 handed over
    as surrogate escapes by the command line: probes HS23, G071-G074, C02, C09, PA30, PA31)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(f"{what} is not valid UTF-8 text (an unpaired surrogate or an undecodable "
                                    f"byte at character {e.start})") from None
    return text


def encode_prompt(model, prompt, chat: bool | None = None, tools: list[dict] | None = None) -> list[int]:
    """A string (plain, or as one user message with ``chat=True``) or a list of chat messages.
    ``tools``: function definitions (OpenAI's ``{"type": "function", "function": {...}}``) for a
    chat template that reads ``tools``."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        else:
            ids = tok.encode(prompt)
            if not ids:
                raise InvalidParameterError("the prompt is empty")
            return ids
    if not isinstance(prompt, list):
        raise InvalidParameterError(
            f"prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}")
    if not prompt:
        raise InvalidParameterError("the message list is empty")
    for i, m in enumerate(prompt):
        _check_message(m, i)
        check_text(m["content"], f"message {i}'s content")
    if not getattr(tok, "chat_template", None):
        raise InvalidParameterError(f"model {model.name} has no chat template; pass a plain string prompt")
    extra = {}
    if tools:
        if "tools" not in str(tok.chat_template):
            raise InvalidParameterError(f"model {model.name}'s chat template does not support tools")
        extra["tools"] = tools
    try:
        out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **extra)
    except TemplateSyntaxError as e:  # probe F24: a broken chat_template.jinja was a traceback
        raise ModelFileError(f"model {model.name}'s chat template is broken ({e}); pass a plain string prompt, "
                             "or repair the model's chat_template") from None
    except TemplateError as e:  # the template's own raise_exception: these messages are not allowed
        raise InvalidParameterError(f"model {model.name}'s chat template refused these messages: {e}") from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def check_max_new_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(f"max_new_tokens must be an integer >= 1, got {value!r}")
    return value


def check_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
        raise InvalidParameterError(f"stop must be a non-empty string or a list of them, got {stop!r:.80}")
    for s in stops:
        check_text(s, "a stop string")
    return list(stops)


def check_prompt_ids(prompt_ids: list[int], model: Any) -> list[int]:
    """The prompt's token ids (a copy) if ``model``'s context holds them and at least one new token."""
    if not prompt_ids:
        raise InvalidParameterError("the prompt is empty")
    if len(prompt_ids) + 1 > model.max_seq_len:
        raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the context of {model.name} holds "
                                 f"{model.max_seq_len} (prompt + at least 1 new token)")
    return list(prompt_ids)
