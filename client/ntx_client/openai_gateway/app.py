"""The HTTP application: OpenAI's routes over the daemons, through ntx_client.AsyncClient only.

    GET  /v1/models, /v1/models/{id}
    POST /v1/chat/completions, /v1/completions     (JSON, or server-sent events with "stream")
    GET  /health, /metrics     (behind the keys too, unless open_monitoring)

A request goes: check the Host → authorize → read the JSON body → parse (protocol.py) → check
the model → generate on the daemon → answer. Nothing a client sends becomes a metric label: the
series are labelled by route. Reading the request itself is bounded by the HTTP server
(serve.py): header and body timeouts, header size, connections.

Each generation tells the daemon which API key it came with (`key_id`: a hash, never the key),
and the daemon keeps each key's cached prompts apart, under the gateway's own uid: one key's
user cannot learn from the prefix cache what another's sent.

Chat messages go to the daemon as messages, never rendered here; a completion's prompt is
tokenized with special tokens not parsed, so "<|im_start|>" typed by a user stays text.
While a request waits for the daemon, its HTTP connection is watched: a client that goes away
cancels the gRPC call, and the daemon frees the slot at its next step. Every failure becomes an
OpenAI error object; no client mistake reaches past the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import urllib.parse

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ntx_client.channels import TLS
from ntx_client.client import AsyncClient, collect_async
from ntx_client.errors import NtxError
from ntx_client.openai_gateway import protocol
from ntx_client.openai_gateway import tools as tools_
from ntx_client.openai_gateway.errors import APIError, bad_request, from_ntx, shown
from ntx_client.openai_gateway.metrics import Metrics
from ntx_proto.states import ServingState

log = logging.getLogger("ntx-openai")

MAX_BODY_BYTES = 8 << 20  # the prompt inside has its own, smaller limit (protocol.MAX_PROMPT_BYTES)
MODEL_TTL_S = 5.0  # how long the daemon's model name is trusted before asking again
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """What ntx-openai is started with (main.py builds it from the flags)."""

    socket: str | None = None  # one daemon on its unix socket (default: the client library's)
    targets: tuple[str, ...] = ()  # or several: socket paths or host:port
    tls: TLS | None = None
    api_keys: frozenset[str] = frozenset()  # empty: no key needed
    open_monitoring: bool = False  # /health and /metrics answer without a key even when keys are set
    allowed_hosts: frozenset[str] = frozenset(LOOPBACK_HOSTS)  # Host header names answered; "*": any


class ClientGone(Exception):
    """The HTTP client disconnected while its request was being served."""


class Daemons:
    """The daemons behind the gateway: one balanced client for generating, one per target for Status.

    Thread rule: created and used on the event loop of the server (grpc.aio channels are bound
    to the loop they were made on)."""

    def __init__(self, config: GatewayConfig):
        kw = dict(targets=list(config.targets), tls=config.tls) if config.targets else dict(socket=config.socket)
        self.client = AsyncClient(**kw)
        self.each = ([AsyncClient(targets=[t], tls=config.tls) for t in config.targets]
                     if len(config.targets) > 1 else [self.client])
        self._model = None
        self._model_at = 0.0

    async def close(self) -> None:
        for c in {id(c): c for c in [self.client, *self.each]}.values():
            await c.close()

    async def model(self):
        if self._model is None or time.monotonic() - self._model_at > MODEL_TTL_S:
            self._model = await self.client.model()
            self._model_at = time.monotonic()
        return self._model

    async def statuses(self) -> list[tuple[str, object]]:
        """(target, StatusResponse or the NtxError) of every daemon, asked at once."""
        async def one(c):
            try:
                return c.socket, await asyncio.wait_for(c.status(), 5.0)
            except (NtxError, asyncio.TimeoutError) as e:
                return c.socket, e
        return list(await asyncio.gather(*(one(c) for c in self.each)))


def model_names(info) -> set[str]:
    """The names a request may give for the daemon's model, case folded: its id (ModelInfo.name,
    the one /v1/models lists) and its aliases (the file's name and stem, the GGUF's name)."""
    return {n.casefold() for n in (info.name, *info.aliases)}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _endpoint(request: Request) -> str:
    """The metrics label of a request: the name of the route that matched it, whatever its path
    (so anyone can add requests, never series), or "other" for a URL no route serves."""
    route = request.scope.get("route")
    return getattr(route, "name", None) or "other"


def _host_name(header: str) -> str:
    """The host of a Host header, lower case, without port or IPv6 brackets ("" if unusable)."""
    try:
        return (urllib.parse.urlsplit("//" + header).hostname or "").lower()
    except ValueError:
        return ""


class AllowedHosts:
    """ASGI middleware: serve only requests whose Host header is one of `hosts` ("*": any).

    A web page can make a browser send requests to 127.0.0.1, and DNS rebinding can make its own
    name resolve there; either way the Host header still carries the page's name, so a gateway
    that answers only to its own names starts no generation for a page a user happens to visit."""

    def __init__(self, app, hosts: frozenset[str]):
        self.app = app
        self.hosts = frozenset(h.lower().strip("[]") for h in hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.hosts:
            return await self.app(scope, receive, send)
        header = Headers(scope=scope).get("host", "")
        if _host_name(header) in self.hosts:
            return await self.app(scope, receive, send)
        err = APIError(400, f"Host {shown(header)!r} is not a name this gateway answers to (it answers to "
                       f"{', '.join(sorted(self.hosts))}): reach it by one of those, or start ntx-openai with "
                       "--allowed-host NAME.", code="invalid_host")
        await _error_response(err)(scope, receive, send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Request, awaitable):
    """Await `awaitable`, cancelling it (and so its gRPC call) if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = Metrics()
        self.daemons: Daemons | None = None

    # ---- plumbing --------------------------------------------------------------------------

    def authorize(self, request: Request) -> str:
        """Check the request's API key; its key_id ("" when the gateway needs no key)."""
        if not self.config.api_keys:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "You didn't provide an API key. Send it in the Authorization header as "
                           "'Authorization: Bearer KEY' (the keys are in the gateway's --api-keys-file).",
                           code="invalid_api_key")
        key = key.strip().encode()
        if not any(hmac.compare_digest(key, k.encode()) for k in self.config.api_keys):
            raise APIError(401, "Incorrect API key provided: it is not in the gateway's --api-keys-file.",
                           code="invalid_api_key")
        return key_id(key)

    def authorize_monitoring(self, request: Request) -> None:
        if not self.config.open_monitoring:
            self.authorize(request)

    async def body(self, request: Request):
        """The parsed JSON body: a JSON content type, at most MAX_BODY_BYTES, and valid Unicode
        (a lone UTF-16 surrogate such as "\\ud800" parses in Python but cannot be sent on)."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, f"The request body must be JSON sent with 'Content-Type: application/json' (it came "
                           f"as {shown(media_type)!r}).", code="unsupported_media_type")
        if request.headers.get("content-length", "0").isdigit() and \
                int(request.headers.get("content-length", "0")) > MAX_BODY_BYTES:
            raise APIError(413, f"The request body is over {MAX_BODY_BYTES >> 20} MiB: shorten the prompt.")
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > MAX_BODY_BYTES:
                raise APIError(413, f"The request body is over {MAX_BODY_BYTES >> 20} MiB: shorten the prompt.")
        try:
            body = json.loads(data)
            json.dumps(body, ensure_ascii=False).encode()  # every string is valid Unicode
        except UnicodeEncodeError:
            raise bad_request("The JSON body holds a lone UTF-16 surrogate escape (such as \\ud800): text must be "
                              "valid Unicode; a character outside the BMP is written as a pair (\\ud83d\\ude00).",
                              None, "invalid_json") from None
        except RecursionError:
            raise bad_request("The JSON body is nested too deeply to read: send a JSON object as the API "
                              "documents it.", None, "invalid_json") from None
        except ValueError as e:  # UnicodeDecodeError included
            raise bad_request(f"We could not parse the JSON body of your request ({shown(str(e))}). Send a JSON "
                              "object with Content-Type: application/json.", None, "invalid_json") from None
        return body

    async def check_model(self, name: str):
        info = await self.daemons.model()
        if name.casefold() not in model_names(info):
            raise APIError(404, f"The model '{shown(name)}' does not exist: this server serves '{info.name}' "
                           "(GET /v1/models lists it).", param="model", code="model_not_found")
        return info

    # ---- routes ------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        info = await self.daemons.model()
        return JSONResponse({"object": "list", "data": [self._model_object(info)]})

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        info = await self.daemons.model()
        name = request.path_params["model"]
        if name.casefold() not in model_names(info):
            raise APIError(404, f"The model '{shown(name)}' does not exist: this server serves '{info.name}'.",
                           param="model", code="model_not_found")
        return JSONResponse(self._model_object(info))

    @staticmethod
    def _model_object(info) -> dict:
        return {"id": info.name, "object": "model", "created": 0, "owned_by": "ntransformer",
                "context_length": info.context_length}

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat", protocol.parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", protocol.parse_completion)

    async def _generate(self, request: Request, endpoint: str, parse) -> Response:
        caller = self.authorize(request)
        job = parse(await self.body(request))
        info = await self.check_model(job.model)
        job.check_max_tokens(info.context_length)
        kw = dict(job.generate, on_behalf_of=caller)
        try:
            if job.prompt is not None:
                kw["prompt_ids"] = await self.daemons.client.tokenize(job.prompt, parse_special=False)
        except NtxError as e:
            raise from_ntx(e, job.param) from None
        self.metrics.in_flight.inc()
        t0 = time.monotonic()
        chunks = self.daemons.client.generate(**kw)
        try:
            if not job.stream:
                return await self._whole(request, job, info.name, chunks, endpoint, t0)
            # the first chunk comes before the 200: a refusal (queue full, prompt too long) keeps its status
            try:
                first = await _unless_gone(request, anext(chunks))
            except StopAsyncIteration:
                first = None
            self.metrics.first_token.labels(endpoint).observe(time.monotonic() - t0)
        except NtxError as e:
            self.metrics.in_flight.dec()
            await chunks.aclose()
            raise from_ntx(e, job.param) from None
        except BaseException:
            self.metrics.in_flight.dec()
            await chunks.aclose()
            raise
        return StreamingResponse(self._events(job, info.name, first, chunks, endpoint, t0),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _whole(self, request, job, model, chunks, endpoint, t0) -> Response:
        async def collect():
            return await collect_async(chunks)
        try:
            done = await _unless_gone(request, collect())
        except NtxError as e:
            raise from_ntx(e, job.param) from None
        usage = protocol.usage_object(done.usage)
        text, calls, logprobs = done.text, None, None
        found = tools_.read_calls(text) if job.kind == "chat" and job.tools.calls_possible else None
        if found is not None:
            text, calls = found
        if job.kind == "chat" and job.logprobs is not None and calls is None:
            logprobs = protocol.chat_logprobs(done.logprobs)
        elif job.kind != "chat":
            prompt = await self._echo(job, done.prompt_ids) if job.echo else None
            if job.logprobs is not None:
                logprobs = await self._completion_logprobs(job, done.prompt_ids, done.prompt_logprobs, done.logprobs,
                                                           prompt, protocol.TextOffset(len(job.prompt or "")))
            text = prompt + text if prompt is not None else text
        self.metrics.done(endpoint, 200, usage, time.monotonic() - t0)
        self.metrics.in_flight.dec()
        return JSONResponse(protocol.completion_object(job, model, text, done.finish_reason, usage,
                                                       logprobs=logprobs, tool_calls=calls))

    async def _echo(self, job, prompt_ids) -> str:
        """The prompt's text, as echo returns it before the completion."""
        return job.prompt if job.prompt is not None else await self.daemons.client.detokenize(prompt_ids)

    async def _completion_logprobs(self, job, prompt_ids, prompt_lps, lps, prompt: str | None,
                                   offset: "protocol.TextOffset") -> dict:
        """The legacy logprobs object: with echo, the prompt's tokens first (its first has none),
        counted from 0; without, the completion's from where it starts (offset)."""
        if prompt is None or not prompt_ids:
            return protocol.completion_logprobs(lps, offset)
        # the first token's bytes: what the prompt holds before the others' (detokenized alone, a
        # part of a character would come back as U+FFFD)
        whole, rest = prompt.encode(), b"".join(t.piece for t in prompt_lps if not t.special)
        head = whole[:len(whole) - len(rest)] if whole.endswith(rest) and len(whole) > len(rest) else \
            (await self.daemons.client.detokenize(prompt_ids[:1])).encode()
        offset.at = 0
        return protocol.completion_logprobs(list(prompt_lps) + list(lps), offset, first=head)

    async def _events(self, job, model, first, chunks, endpoint, t0):
        status, usage = 200, None
        chat = job.kind == "chat"
        # a reply that may hold calls: its text goes out once it cannot be a call's start (tools.py)
        watch = tools_.CallWatch(forced=job.tools.choice != "auto") if chat and job.tools.calls_possible else None
        offset = protocol.TextOffset(len(job.prompt or ""))  # completions: where the next token's text starts
        try:
            if chat:
                yield _sse(protocol.chunk_object(job, model, "", None, first=True))
            pending = [first] if first is not None else []
            started = False
            while True:
                c = pending.pop() if pending else await anext(chunks, None)
                if c is None:
                    break
                if chat:
                    out = watch.push(c) if watch is not None else [c]
                    if c.finish_reason is not None and watch is not None:
                        head, calls, rest = watch.finish()
                        out += rest
                        if calls:
                            for event in self._content(job, model, out):
                                yield event
                            if head:
                                yield _sse(protocol.chunk_object(job, model, head, None))
                            yield _sse(protocol.chunk_object(job, model, None, None, tool_calls=calls))
                            yield _sse(protocol.chunk_object(job, model, None, "tool_calls"))
                            usage = protocol.usage_object(c.usage)
                            continue
                    for event in self._content(job, model, out):
                        yield event
                else:
                    text, logprobs = c.text, None
                    if not started and job.echo:
                        prompt = await self._echo(job, c.prompt_ids)
                        if job.logprobs is not None:
                            logprobs = await self._completion_logprobs(job, c.prompt_ids, c.prompt_logprobs,
                                                                       c.logprobs, prompt, offset)
                        text = prompt + text
                    elif job.logprobs is not None:
                        logprobs = protocol.completion_logprobs(c.logprobs, offset)
                    started = True
                    if text or (logprobs is not None and logprobs["tokens"]):
                        yield _sse(protocol.chunk_object(job, model, text, None, logprobs=logprobs))
                if c.finish_reason is not None:
                    yield _sse(protocol.chunk_object(job, model, None, c.finish_reason))
                    usage = protocol.usage_object(c.usage)
            if job.include_usage and usage is not None:
                yield _sse(protocol.usage_chunk(job, model, usage))
            yield "data: [DONE]\n\n"
        except NtxError as e:  # after the 200 the status line is gone: the error goes in the stream
            err = from_ntx(e, job.param)
            status = err.status
            yield _sse(err.body())
        except asyncio.CancelledError:
            status = 499  # the client went away; the cancelled call frees the daemon's slot
            raise
        finally:
            await chunks.aclose()
            self.metrics.in_flight.dec()
            self.metrics.done(endpoint, status, usage, time.monotonic() - t0)

    @staticmethod
    def _content(job, model, chunks) -> list[str]:
        """The chat events of the content of `chunks` (client library Chunks): one each, with its
        tokens' log-probabilities; none for a chunk that adds nothing."""
        events = []
        for c in chunks:
            logprobs = protocol.chat_logprobs(c.logprobs) if job.logprobs is not None else None
            if c.text or (logprobs is not None and logprobs["content"]):
                events.append(_sse(protocol.chunk_object(job, model, c.text, None, logprobs=logprobs)))
        return events

    async def health(self, request: Request) -> Response:
        self.authorize_monitoring(request)
        daemons = []
        for target, s in await self.daemons.statuses():
            if isinstance(s, BaseException):
                daemons.append({"target": target, "state": "unreachable", "error": str(s) or type(s).__name__})
            else:
                daemons.append({"target": target, "state": ServingState(s.state).name.lower(), "model": s.model,
                                "live_requests": s.live_requests, "queued_requests": s.queued_requests})
        ok = any(d["state"] == "serving" for d in daemons)
        return JSONResponse({"status": "ok" if ok else "unavailable", "daemons": daemons},
                            status_code=200 if ok else 503)

    async def metrics_page(self, request: Request) -> Response:
        self.authorize_monitoring(request)
        body, content_type = self.metrics.render(await self.daemons.statuses())
        return Response(body, media_type=content_type)


def create_app(config: GatewayConfig) -> Starlette:
    gw = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        gw.daemons = Daemons(config)
        try:
            yield
        finally:
            await gw.daemons.close()

    async def api_error(request, exc: APIError):
        gw.metrics.failed(_endpoint(request), exc.status)
        return _error_response(exc)

    async def ntx_error(request, exc: NtxError):
        err = from_ntx(exc)
        gw.metrics.failed(_endpoint(request), err.status)
        return _error_response(err)

    async def http_error(request, exc: HTTPException):
        gw.metrics.failed(_endpoint(request), exc.status_code)
        path = shown(request.url.path)
        message = {404: f"Unknown request URL: {request.method} {path}. See GET /v1/models, POST "
                        "/v1/chat/completions and POST /v1/completions.",
                   405: f"Method {request.method} is not allowed on {path}."}.get(exc.status_code, str(exc.detail))
        return _error_response(APIError(exc.status_code, message, code="unknown_url" if exc.status_code == 404
                                        else None))

    async def gone(request, exc):
        return Response(status_code=499)

    async def unexpected(request, exc: Exception):
        log.exception("unexpected error serving %s", shown(request.url.path), exc_info=exc)
        gw.metrics.failed(_endpoint(request), 500)
        return _error_response(APIError(500, f"The gateway failed on this request ({type(exc).__name__}: "
                                        f"{shown(str(exc))}); see ntx-openai's log."))

    routes = [
        Route("/v1/models", gw.models, methods=["GET"], name="models"),
        Route("/v1/models/{model:path}", gw.model, methods=["GET"], name="model"),
        Route("/v1/chat/completions", gw.chat, methods=["POST"], name="chat"),
        Route("/v1/completions", gw.completions, methods=["POST"], name="completions"),
        Route("/health", gw.health, methods=["GET"], name="health"),
        Route("/metrics", gw.metrics_page, methods=["GET"], name="metrics"),
    ]
    middleware = [Middleware(AllowedHosts, hosts=config.allowed_hosts)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware, exception_handlers={
        APIError: api_error, NtxError: ntx_error, HTTPException: http_error, ClientGone: gone,
        ClientDisconnect: gone, Exception: unexpected})
    app.state.gateway = gw
    return app


def key_id(key: bytes) -> str:
    """The identity of an API key that the daemon scopes its prefix cache by: a hash, so the key
    itself never leaves the gateway; the same key always gives the same id."""
    return "key:" + hashlib.sha256(b"ntx-openai api key\0" + key).hexdigest()[:24]


def read_api_keys(path: str) -> frozenset[str]:
    """One key per line; blank lines and lines starting with # are skipped."""
    try:
        with open(path) as f:
            keys = frozenset(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    except OSError as e:
        raise SystemExit(f"ntx-openai: cannot read the API keys file {path}: {e.strerror}") from None
    if not keys:
        raise SystemExit(f"ntx-openai: the API keys file {path} has no key: put one key per line, or leave out "
                         "--api-keys-file to serve without keys")
    return keys


__all__ = ["LOOPBACK_HOSTS", "GatewayConfig", "create_app", "key_id", "read_api_keys"]
