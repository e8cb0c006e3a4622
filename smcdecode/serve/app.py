"""The HTTP layer: OpenAI-compatible routes over any :class:`~.executor.Executor` (starlette).

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics

A request is parsed and checked (``protocol``), prepared off the event loop (tokenised, its
constraint compiled: bad input is a 400 before it is queued), submitted (a full queue is a 429)
and answered whole or as server-sent events. A client that goes away cancels its request: a queued
one leaves the queue, a running one stops at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import traceback

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..errors import SMCDecodeError
from . import metrics
from .executor import Executor, Job
from .protocol import Defaults, Limits, RequestError, parse
from .stream import chunk, response, sse, usage


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _run_error(e: BaseException) -> RequestError:
    """An exception from a run as the error the client gets: bad input (SMCDecodeError) is a 400,
    anything else a 500 (a bug: its type and message are passed on)."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, SMCDecodeError):
        return RequestError(str(e))
    traceback.print_exception(e, file=sys.stderr)  # (for the server's log)
    return RequestError(f"internal error: {type(e).__name__}: {str(e)[:300]}", status=500)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read, so only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse_events(job: Job, batch: list) -> tuple[bytes, bool]:
    """The server-sent events of a job's events (consecutive deltas of one choice as one chunk),
    and whether the stream ends with them."""
    out: list[bytes] = []
    pending: list = []  # [index, text] of the deltas not written yet

    def write_pending():
        if pending:
            out.append(sse(chunk(job, pending[0], pending[1])))
            pending.clear()

    for kind, *rest in batch:
        if kind == "delta":
            if pending and pending[0] != rest[0]:
                write_pending()
            if pending:
                pending[1] += rest[1]
            else:
                pending.extend(rest)
            continue
        write_pending()
        if kind == "choice":
            c, tail = rest
            if tail:
                out.append(sse(chunk(job, c.index, tail)))
            out.append(sse(chunk(job, c.index, None, c.finish_reason, logprobs=c.logprobs)))
        elif kind == "done":
            last = chunk(job, 0)
            last["choices"] = []
            last["smc"] = rest[0].smc
            if job.spec.include_usage:
                last["usage"] = usage(rest[0])
            out += [sse(last), sse("[DONE]")]
            return b"".join(out), True
        else:
            out.append(sse(_run_error(rest[0]).body()))
            return b"".join(out), True
    write_pending()
    return b"".join(out), False


def create_app(executor: Executor, *, limits: Limits, defaults: Defaults) -> Starlette:
    """The ASGI application serving ``executor``."""
    stats = executor.stats

    async def prepare(request: Request, endpoint: str) -> Job:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not valid JSON") from None
        spec = parse(body, endpoint, limits, defaults)
        if body.get("model") is not None and body["model"] != executor.model_name:
            raise RequestError(f"model {body['model']!r} is not served here: this server serves "
                               f"{executor.model_name!r} (GET /v1/models)", "model", status=404,
                               code="model_not_found")
        loop = asyncio.get_running_loop()
        job = await anyio.to_thread.run_sync(executor.prepare, spec, loop)
        executor.submit(job)
        return job

    async def wait(job: Job, request: Request):
        """The job's last event, or None if the client went away first (the job is then cancelled)."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                event = asyncio.ensure_future(job.events.get())
                done, _ = await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                if event not in done:
                    event.cancel()
                    executor.cancel(job)
                    return None
                if event.result()[0] in ("done", "error"):
                    return event.result()
        finally:
            gone.cancel()

    async def events(job: Job, request: Request):
        spec = job.spec
        # NOTE: under ASGI 2.4 starlette notices a client that went away only when a send fails, and a
        # stream may send nothing for a long time (SMC's particles may not agree yet): watch for it here
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            if spec.endpoint == "chat":
                for i in range(spec.n):
                    yield sse(chunk(job, i, "", role=True))
            while not gone.done():
                if job.events.empty():
                    event = asyncio.ensure_future(job.events.get())
                    done, _ = await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if event not in done:
                        event.cancel()
                        return
                    batch = [event.result()]
                else:
                    batch = []
                while not job.events.empty():  # every event that has arrived, in one write
                    batch.append(job.events.get_nowait())
                body, ended = _sse_events(job, batch)
                yield body
                if ended:
                    return
        finally:  # the client went away (or the task was cancelled), or the stream ended
            gone.cancel()
            executor.cancel(job)

    async def complete(request: Request, endpoint: str):
        try:
            job = await prepare(request, endpoint)
        except RequestError as e:
            stats.count_request(endpoint, e.status)
            return _error(e)
        if job.spec.stream:
            stats.count_request(endpoint, 200)
            return StreamingResponse(events(job, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        last = await wait(job, request)
        if last is None:
            stats.count_request(endpoint, 499)  # client closed the request
            return PlainTextResponse("", status_code=499)
        if last[0] == "error":
            e = _run_error(last[1])
            stats.count_request(endpoint, e.status)
            return _error(e)
        stats.count_request(endpoint, 200)
        return JSONResponse(response(job, last[1]))

    async def chat(request: Request):
        return await complete(request, "chat")

    async def completions(request: Request):
        return await complete(request, "completions")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": executor.model_name, "object": "model", "created": started, "owned_by": "smcdecode"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def metrics_text(request: Request):
        return PlainTextResponse(metrics.render(stats, executor.gauges()),
                                 media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException):
        e = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
        return _error(e)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await anyio.to_thread.run_sync(executor.close)

    started = int(time.time())
    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/metrics", metrics_text, methods=["GET"])],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    return app
