"""Answering a request from its job's events: one JSON response, or a server-sent event stream.

``answer`` submits the job and reads its events (``JobEvents``: with the request's deadline,
and a watcher that cancels the job when the client hangs up).  A streamed answer waits for the
first event before it starts, so that an error found while building the generation is still an
HTTP error status; later errors are sent as an error event before ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from .config import ServeConfig
from .engine import Delta, Disconnected, Ended, Engine, Event, Failed, Finished, Job, Started
from .errors import RequestTimeout, api_error
from .prepare import Prepared
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                       ChatDelta, CompletionChoice, CompletionChunk, CompletionResponse, FunctionCallOut, ToolCallDelta,
                       ToolCallOut, Usage)
from .tools import ToolCall, ToolTextFilter, parse_tool_calls

CLIENT_CLOSED = 499  # nginx's status for a client that hung up; nobody reads it


# ---------------------------------------------------------------------------- events of one job
class JobEvents:
    """The events of a submitted job, as the request sees them."""

    def __init__(self, engine: Engine, job: Job, request: Request, timeout: float) -> None:
        self.engine, self.job, self.timeout = engine, job, timeout
        self._watcher = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.engine.cancel(self.job, "disconnect")
                    self.job.events.put_nowait(Disconnected())
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # the connection is gone in some other way
            return

    async def next(self) -> Event:
        remaining = self.job.remaining()
        try:
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError
            return await asyncio.wait_for(self.job.events.get(), timeout=remaining)
        except asyncio.TimeoutError:
            self.engine.cancel(self.job, "timeout")
            raise RequestTimeout(self.timeout) from None

    @property
    def timed_out(self) -> bool:
        return self.job.cancel_reason == "timeout"

    def close(self, cancel: bool = True) -> None:
        """Stop watching; cancel the job (a no-op when it is over)."""
        self._watcher.cancel()
        if cancel:
            self.engine.cancel(self.job, "disconnect")


# ---------------------------------------------------------------------------- response pieces
def finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "length"


def tool_finish_reason(reason: str, calls) -> str:
    """``tool_calls`` for an answer that ended by itself with calls (OpenAI's reason)."""
    return "tool_calls" if calls and reason == "stop" else finish_reason(reason)


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


def chat_choice(prep: Prepared, k: int, result) -> ChatChoice:
    """One choice of a chat answer: its text, or (with tools) its content and tool calls."""
    if prep.tools is None:
        return ChatChoice(index=k, message=AssistantMessage(content=result.text),
                          finish_reason=finish_reason(result.finish_reason))
    parsed = parse_tool_calls(result.text, prep.tools.names)
    calls = [tool_call_out(c) for c in parsed.calls]
    message = AssistantMessage(content=parsed.content if calls else result.text, tool_calls=calls or None)
    return ChatChoice(index=k, message=message, finish_reason=tool_finish_reason(result.finish_reason, calls))


def usage(prompt_lens: list[int], results: list) -> Usage:
    p = sum(prompt_lens)
    c = sum(len(r.tokens) for r in results if r is not None)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


CHOICE_STATS = ("method", "new_tokens", "target_forwards", "mean_accepted", "tokens_per_s", "wall_s", "prefill_s",
                "accept_hist", "score", "logprob")


def stats_field(prep: Prepared, job: Job, results: list) -> dict[str, Any]:
    """The ``leapdecode`` field of a response: the method, its draft, and decoding statistics."""
    results = [r for r in results if r is not None]
    tokens = sum(len(r.tokens) for r in results)
    forwards = sum(int(r.stats.get("target_forwards", 0)) for r in results)
    wall = sum(float(r.stats.get("wall_s", 0.0)) for r in results)
    out: dict[str, Any] = {
        "method": prep.method,
        "draft": prep.draft,
        "mean_accepted": round(tokens / forwards, 4) if forwards else 0.0,
        "target_forwards": forwards,
        "new_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
        "queue_s": round((job.started_at or job.enqueued_at) - job.enqueued_at, 4),
    }
    if prep.strategy is not None:  # a search: its statistics, and each choice's score
        out["strategy"] = prep.strategy
        if len(results) == 1:
            out.update({k: results[0].stats[k] for k in ("score", "logprob") if k in results[0].stats})
    if len(results) > 1:
        out["choices"] = [{k: r.stats[k] for k in CHOICE_STATS if k in r.stats} for r in results]
    return out


def sse(obj: BaseModel | dict, exclude: set[str] | None = None) -> str:
    data = obj.model_dump_json(exclude=exclude) if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


class Chunks:
    """The SSE chunks of one streamed answer.  With tools, a choice's content goes through a
    ``ToolTextFilter`` (what may be a tool call is held back) and its calls are sent whole, in one
    ``tool_calls`` delta before its last chunk."""

    def __init__(self, prep: Prepared, rid: str, created: int, model_name: str) -> None:
        self.prep, self.chat = prep, prep.kind == "chat"
        self.common = dict(id=rid, created=created, model=model_name)
        self.exclude = None if prep.include_usage else {"usage"}
        self.filters: dict[int, ToolTextFilter] = {}

    def _filter(self, k: int) -> ToolTextFilter | None:
        tools = self.prep.tools if self.chat else None
        if tools is None:
            return None
        if k not in self.filters:
            self.filters[k] = ToolTextFilter(tools.names, hold_all=tools.constrained)
        return self.filters[k]

    def _choice(self, k: int, text: str | None, finish: str | None = None, role: bool = False, **more) -> str:
        if self.chat:
            choice = ChatChunkChoice(index=k, delta=ChatDelta(role="assistant" if role else None, content=text),
                                     finish_reason=finish)
            return sse(ChatCompletionChunk(**self.common, choices=[choice], **more), self.exclude)
        choice = CompletionChoice(index=k, text=text or "", finish_reason=finish)
        return sse(CompletionChunk(**self.common, choices=[choice], **more), self.exclude)

    def started(self, k: int) -> str | None:
        if self.chat:
            return self._choice(k, "", role=True)
        if self.prep.echo:
            return self._choice(k, self.prep.echo[k // self.prep.n])
        return None

    def text(self, k: int, text: str) -> str | None:
        f = self._filter(k)
        if f is not None:
            text = f.feed(text)
            if not text:
                return None
        return self._choice(k, text)

    def finished(self, k: int, result, stats: dict) -> str:
        f = self._filter(k)
        if f is None:
            return self._choice(k, None if self.chat else "", finish_reason(result.finish_reason), leapdecode=stats)
        rest, calls = f.finish(result.text)
        out = self._choice(k, rest) if rest else ""
        if calls:
            delta = ChatDelta(tool_calls=[ToolCallDelta(index=i, **tool_call_out(c).model_dump())
                                          for i, c in enumerate(calls)])
            out += sse(ChatCompletionChunk(**self.common, choices=[ChatChunkChoice(index=k, delta=delta)]),
                       self.exclude)
        return out + self._choice(k, None, tool_finish_reason(result.finish_reason, calls), leapdecode=stats)

    def usage(self, u: Usage, stats: dict) -> str:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return sse(cls(**self.common, choices=[], usage=u, leapdecode=stats))


# ---------------------------------------------------------------------------- the answer
async def answer(request: Request, engine: Engine, prep: Prepared, cfg: ServeConfig) -> Response:
    """Submit the request's generations and answer (JSON, or an SSE stream)."""
    job = Job(prep.specs, deadline=time.monotonic() + cfg.request_timeout)
    engine.submit(job)  # QueueFullError: 429
    events = JobEvents(engine, job, request, cfg.request_timeout)
    rid = ("chatcmpl-" if prep.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    handed_over = False
    try:
        if not prep.stream:
            return await _json_answer(events, prep, rid, created, cfg.model_name)
        first = await events.next()
        if isinstance(first, Failed):
            raise api_error(first.error, first.error_id)
        if isinstance(first, (Disconnected, Ended)):  # gone, or cancelled before it started
            if events.timed_out:
                raise RequestTimeout(cfg.request_timeout)
            return Response(status_code=CLIENT_CLOSED)
        handed_over = True
        return StreamingResponse(_stream(events, first, Chunks(prep, rid, created, cfg.model_name), prep),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finally:
        if not handed_over:
            events.close()


async def _json_answer(events: JobEvents, prep: Prepared, rid: str, created: int, model_name: str) -> Response:
    results: list = [None] * prep.choices
    while True:
        ev = await events.next()
        if isinstance(ev, Finished):
            results[ev.index] = ev.result
        elif isinstance(ev, Failed):
            raise api_error(ev.error, ev.error_id)
        elif isinstance(ev, Disconnected):
            return Response(status_code=CLIENT_CLOSED)
        elif isinstance(ev, Ended):
            break
    if events.timed_out:
        raise RequestTimeout(events.timeout)
    if events.job.cancelled:
        return Response(status_code=CLIENT_CLOSED)
    common = dict(id=rid, created=created, model=model_name, usage=usage(prep.prompt_lens, results),
                  leapdecode=stats_field(prep, events.job, results))
    if prep.kind == "chat":
        body = ChatCompletionResponse(**common, choices=[chat_choice(prep, k, r) for k, r in enumerate(results)])
    else:
        body = CompletionResponse(**common, choices=[
            CompletionChoice(index=k, text=(prep.echo[k // prep.n] if prep.echo else "") + r.text,
                             finish_reason=finish_reason(r.finish_reason))
            for k, r in enumerate(results)])
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(events: JobEvents, ev: Event, chunks: Chunks, prep: Prepared) -> AsyncIterator[str]:
    job = events.job
    results: list = [None] * prep.choices
    over = False  # the job ended by itself (nothing to cancel)
    try:
        while True:
            if isinstance(ev, Started):
                piece = chunks.started(ev.index)
                if piece:
                    yield piece
            elif isinstance(ev, Delta):
                piece = chunks.text(ev.index, ev.text) if ev.text else None
                if piece:
                    yield piece
            elif isinstance(ev, Finished):
                results[ev.index] = ev.result
                if ev.result.finish_reason != "cancelled":
                    yield chunks.finished(ev.index, ev.result, stats_field(prep, job, [ev.result]))
            elif isinstance(ev, Failed):
                over = True  # the engine stopped the job itself
                yield sse(api_error(ev.error, ev.error_id).body())
                break
            elif isinstance(ev, Ended):
                over = True
                if events.timed_out:
                    yield sse(api_error(RequestTimeout(events.timeout)).body())
                elif job.cancelled:
                    return
                elif prep.include_usage:
                    yield chunks.usage(usage(prep.prompt_lens, results), stats_field(prep, job, results))
                break
            elif isinstance(ev, Disconnected):
                return
            ev = await events.next()
        yield "data: [DONE]\n\n"
    except Exception as e:  # a timeout, or a fault of this generator: an error event (500s are logged with an id)
        yield sse(api_error(e).body())
        yield "data: [DONE]\n\n"
    finally:
        events.close(cancel=not over)
