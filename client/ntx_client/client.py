"""Client and AsyncClient for ntransformerd, over its unix socket or on TCP with TLS.

    from ntx_client import Client
    with Client() as c:                               # socket: NTX_SOCKET or /run/ntransformer/…
        for chunk in c.generate("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)

    Client(targets=["gpu1:7443", "gpu2:7443"], tls=TLS(ca=…, cert=…, key=…))   # several hosts
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ntx_client import channels
from ntx_client.errors import ConnectionFailed, NtxError, RequestTooLarge, connection_error, from_rpc_error
from ntx_proto import paths
from ntx_proto.ntransformer.v1 import admin_pb2, admin_pb2_grpc, inference_pb2 as pb, inference_pb2_grpc
from ntx_proto.wire import FIELD_METADATA, piece_text

from ntx_proto.cli import CHAT_REPETITION_PENALTY, DEFAULT_TEMPERATURE  # noqa: F401 - the command lines' defaults
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS: "eos"}
# The daemon compiles at most this much constraint text (proto Constraint); a larger one is refused
# here, before sending, with the same words (a request past gRPC's 4 MiB message limit would
# otherwise come back as RESOURCE_EXHAUSTED, which names neither the field nor the limit).
MAX_CONSTRAINT_BYTES = 1 << 20
MAX_INT64 = (1 << 63) - 1
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "frequency_penalty", "presence_penalty", "seed")


@dataclasses.dataclass
class TokenLogprob:
    """A token's log-probability and, where asked for, the most likely tokens at its position."""

    id: int
    piece: bytes  # the token's bytes (may hold part of a UTF-8 character)
    logprob: float
    top: list["TokenLogprob"] = dataclasses.field(default_factory=list)
    special: bool = False  # a control token: piece is its name, it adds nothing to the text

    @classmethod
    def from_pb(cls, m: pb.TokenLogprob) -> "TokenLogprob":
        return cls(m.id, m.piece, m.logprob, [cls(t.id, t.piece, t.logprob, special=t.special) for t in m.top],
                   m.special)

    @property
    def text(self) -> str:
        """The token as text (piece_text)."""
        return piece_text(self.piece)


class FieldError(NtxError, ValueError):
    """The daemon refused a request for one of its fields (INVALID_ARGUMENT): `field` is its
    name in GenerateRequest ("max_tokens", "constraint.json_schema", "sampling.temperature")."""

    def __init__(self, message: str, field: str):
        super().__init__(message, grpc.StatusCode.INVALID_ARGUMENT)
        self.field = field


def _rpc_error(e: grpc.RpcError, socket: str) -> NtxError:
    """The NtxError of a failed call: a FieldError where the daemon named the field at fault."""
    err = from_rpc_error(e, socket)
    try:
        field = dict(e.trailing_metadata() or ()).get(FIELD_METADATA)
    except (AttributeError, TypeError, ValueError):  # not a call's error (no metadata)
        field = None
    return FieldError(str(err), field) if field and err.code == grpc.StatusCode.INVALID_ARGUMENT else err


@dataclasses.dataclass
class Chunk:
    """One streamed piece of a generation. The last one has finish_reason and usage; logprobs
    (one per id) where asked for, prompt_logprobs (prompt_ids[1:]) on the first."""

    text: str
    ids: list[int]
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "eos"
    usage: dict | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)

    @classmethod
    def from_pb(cls, m: pb.GenerateResponse) -> "Chunk":
        usage = None
        if m.HasField("usage"):
            u = m.usage
            usage = dict(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         queue_seconds=u.queue_seconds, prefill_seconds=u.prefill_seconds,
                         decode_seconds=u.decode_seconds, cached_prompt_tokens=u.cached_prompt_tokens)
        return cls(m.text, list(m.token_ids), list(m.prompt_ids), FINISH_REASONS.get(m.finish_reason), usage,
                   [TokenLogprob.from_pb(x) for x in m.logprobs], [TokenLogprob.from_pb(x) for x in m.prompt_logprobs])


@dataclasses.dataclass
class Completion:
    """A whole generation, collected from its chunks."""

    text: str
    ids: list[int]
    prompt_ids: list[int]
    finish_reason: str | None
    usage: dict | None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


def collect(chunks) -> Completion:
    text, ids, prompt_ids, lps, prompt_lps, last = [], [], [], [], [], None
    for c in chunks:
        text.append(c.text)
        ids += c.ids
        prompt_ids += c.prompt_ids
        lps += c.logprobs
        prompt_lps += c.prompt_logprobs
        last = c
    return Completion("".join(text), ids, prompt_ids, last and last.finish_reason, last and last.usage, lps,
                      prompt_lps)


async def collect_async(chunks) -> Completion:
    """collect() of an async iterator of chunks."""
    return collect([c async for c in chunks])


def generate_request(prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                     tools: Sequence[dict] | None = None,
                     prompt_ids: Sequence[int] | None = None, max_tokens: int | None = None,
                     stop: Sequence[str] = (), ignore_eos: bool = False, model: str = "",
                     prefix_cache: bool = True, speculative: str = "", json_schema: str | dict | None = None,
                     regex: str | None = None, grammar: str | None = None, max_digits: int | None = None,
                     logprobs: int | None = None, prompt_logprobs: bool = False, on_behalf_of: str = "",
                     **sampling) -> pb.GenerateRequest:
    """Build a GenerateRequest; exactly one of prompt, messages, prompt_ids; with messages, tools
    for the chat template to show the model (chat_message; only a constraint forces a call's
    shape). prefix_cache=False: the daemon neither starts from cached KV nor keeps this
    request's. speculative: "" (the daemon's default), off, auto, ngram, draft, skip or prefix.
    At most one constraint: json_schema (JSON text or a dict), regex, grammar (Lark or GBNF), of
    at most MAX_CONSTRAINT_BYTES (RequestTooLarge, before sending); max_digits: the most digits
    in a row outside JSON strings (proto Constraint; 0: no bound). max_tokens: 1..the context
    length (ModelInfo.context_length). logprobs: each token's
    log-probability and its n (0..20) most likely alternatives'; prompt_logprobs: the prompt's too.
    on_behalf_of: who a proxy sends this for (e.g. "key:3fa1c2"), a scope below its own: the
    daemon's prefix cache keeps each one's prompts apart."""
    if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_ids")
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one constraint, not {' and '.join(given)}")
    if tools and messages is None:
        raise ValueError("tools go with messages (a chat): the model's chat template renders them")
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    req = pb.GenerateRequest(model=model, stop=list(stop), ignore_eos=ignore_eos, no_prefix_cache=not prefix_cache,
                             speculative=speculative or "", on_behalf_of=on_behalf_of)
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        req.chat.CopyFrom(chat_message(messages, tools))
    else:
        req.prompt_ids.ids.extend(prompt_ids)
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_INT64:
            raise ValueError(f"max_tokens {max_tokens!r} is out of range: use 1..the context length "
                             "(ntx-client models shows it)")
        req.max_tokens = max_tokens
    for kind, text in given.items():
        text = json.dumps(text) if isinstance(text, dict) else text
        check_constraint_size(kind, text)
        setattr(req.constraint, kind, text)
    if max_digits is not None:
        if not given:
            raise ValueError("max_digits bounds a constraint's numbers: give json_schema, regex or grammar with it")
        req.constraint.max_digits = max_digits
    if logprobs is not None:
        req.logprobs = logprobs
    req.prompt_logprobs = prompt_logprobs
    for k, v in sampling.items():
        if v is not None:
            setattr(req.sampling, k, v)
    return req


def check_constraint_size(kind: str, text: str) -> None:
    """RequestTooLarge where `text` is more constraint text than the daemon takes."""
    size = len(text.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise RequestTooLarge(f"constraint.{kind} is {size:,} bytes; the daemon takes at most "
                              f"{MAX_CONSTRAINT_BYTES >> 20} MiB ({MAX_CONSTRAINT_BYTES:,} bytes) of constraint text: "
                              "shorten or simplify it")


def _json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def chat_message(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> pb.Chat:
    """A Chat from OpenAI-shaped dicts: messages {"role", "content"}, an assistant's
    "tool_calls" ([{"id", "type": "function", "function": {"name", "arguments"}}]), a tool
    result's "tool_call_id"; tools [{"type": "function", "function": {"name", "description",
    "parameters"}}]. Arguments and parameters may be JSON text or objects."""
    chat = pb.Chat()
    for m in messages:
        msg = chat.messages.add(role=m["role"], content=m.get("content") or "",
                                tool_call_id=m.get("tool_call_id") or "")
        for c in m.get("tool_calls") or ():
            fn = c["function"]
            msg.tool_calls.add(id=c.get("id") or "", name=fn["name"], arguments=_json_text(fn.get("arguments", {})))
    for t in tools or ():
        fn = t["function"]
        chat.tools.add(name=fn["name"], description=fn.get("description") or "",
                       parameters=_json_text(fn["parameters"]) if fn.get("parameters") is not None else "")
    return chat


def _tokenize_request(text, messages, add_special, parse_special, tools=None) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    if messages is not None:
        req.chat.CopyFrom(chat_message(messages, tools))
    else:
        req.text = text
    if add_special is not None:
        req.add_special = add_special
    if parse_special is not None:
        req.parse_special = parse_special
    return req


class _Channel:
    """A gRPC channel held by a client: usable as a context manager, closed by close()."""

    _channel: grpc.Channel

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._channel.close()


def _targets(socket: str | None, targets: Sequence[str] | None) -> tuple[list[str], str]:
    """(targets, what errors call them): `targets` if given, else the one unix socket."""
    if targets:
        if socket:
            raise channels.TargetError("give a socket or targets, not both")
        return list(targets), channels.describe(targets)
    path = paths.socket_path(socket)
    return [path], path


class Client(_Channel):
    """Blocking client. Methods raise ntx_client.NtxError with a message naming cause and fix.

    `socket`: the daemon's unix socket (default $NTX_SOCKET, then the system one). `targets`:
    instead, socket paths or host:port of one or more daemons (see ntx_client.channels); TCP
    needs `tls`."""

    def __init__(self, socket: str | None = None, *, targets: Sequence[str] | None = None,
                 tls: channels.TLS | None = None, timeout: float | None = None):
        self.targets, self.socket = _targets(socket, targets)
        self.timeout = timeout
        self._channel = channels.open_channel(self.targets, tls)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    def _call(self, method, request, timeout=None):
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.socket) from None

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Iterator[Chunk]:
        """Stream chunks; stopping the iteration early cancels the request on the daemon."""
        call = self._stub.Generate(generate_request(prompt, **kw), timeout=timeout or self.timeout)
        try:
            for m in call:
                yield Chunk.from_pb(m)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.socket) from None
        finally:
            call.cancel()  # no-op once finished; frees the daemon's slot if we stopped early

    def chat(self, messages: Sequence[dict], **kw) -> Iterator[Chunk]:
        return self.generate(messages=messages, **kw)

    def complete(self, prompt: str | None = None, **kw) -> Completion:
        return collect(self.generate(prompt, **kw))

    def tokenize(self, text: str | None = None, *, messages=None, tools=None, add_special=None,
                 parse_special=None) -> list[int]:
        req = _tokenize_request(text, messages, add_special, parse_special, tools)
        return list(self._call(self._stub.Tokenize, req).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._call(self._stub.Detokenize, pb.DetokenizeRequest(ids=list(ids))).text

    def model(self) -> pb.ModelInfo:
        return self._call(self._stub.GetModel, pb.GetModelRequest())

    def status(self) -> pb.StatusResponse:
        return self._call(self._stub.Status, pb.StatusRequest())

    def health(self, timeout: float = 5.0) -> str:
        """The standard gRPC health status of the inference service: SERVING, NOT_SERVING, …"""
        stub = health_pb2_grpc.HealthStub(self._channel)
        r = self._call(stub.Check, health_pb2.HealthCheckRequest(service=channels.INFERENCE_SERVICE), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the daemon answers SERVING (the model is loaded)."""
        end, last = time.monotonic() + timeout, None
        while time.monotonic() < end:
            try:
                if self.health(timeout=max(0.1, min(2.0, end - time.monotonic()))) == "SERVING":
                    return
            except NtxError as e:
                last = e
            time.sleep(0.1)
        raise last or NtxError(f"ntransformerd at {self.socket} did not become ready within {timeout} s")


class AsyncClient:
    """asyncio client (grpc.aio) with the same methods as Client, awaited."""

    def __init__(self, socket: str | None = None, *, targets: Sequence[str] | None = None,
                 tls: channels.TLS | None = None, timeout: float | None = None):
        self.targets, self.socket = _targets(socket, targets)
        self.timeout = timeout
        self._channel = channels.open_channel(self.targets, tls, aio=True)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.socket) from None

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(generate_request(prompt, **kw), timeout=timeout or self.timeout)
        try:
            async for m in call:
                yield Chunk.from_pb(m)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.socket) from None
        finally:
            call.cancel()

    def chat(self, messages: Sequence[dict], **kw) -> AsyncIterator[Chunk]:
        return self.generate(messages=messages, **kw)

    async def complete(self, prompt: str | None = None, **kw) -> Completion:
        return collect([c async for c in self.generate(prompt, **kw)])

    async def tokenize(self, text: str | None = None, *, messages=None, tools=None, add_special=None,
                       parse_special=None) -> list[int]:
        r = await self._call(self._stub.Tokenize, _tokenize_request(text, messages, add_special, parse_special, tools))
        return list(r.ids)

    async def detokenize(self, ids: Sequence[int]) -> str:
        return (await self._call(self._stub.Detokenize, pb.DetokenizeRequest(ids=list(ids)))).text

    async def model(self) -> pb.ModelInfo:
        return await self._call(self._stub.GetModel, pb.GetModelRequest())

    async def status(self) -> pb.StatusResponse:
        return await self._call(self._stub.Status, pb.StatusRequest())

    async def health(self, timeout: float = 5.0) -> str:
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=channels.INFERENCE_SERVICE), timeout=timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.socket) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class AdminClient(_Channel):
    """The admin verbs, over the root-only admin socket."""

    def __init__(self, socket: str | None = None, *, user_socket: str | None = None, timeout: float | None = None):
        self.socket = paths.admin_socket_path(socket, user_socket=user_socket)
        if not self.socket:
            raise ConnectionFailed("no admin socket to reach: a daemon run by a user other than root keeps it in "
                                   "$XDG_RUNTIME_DIR, which is not set here; pass the daemon's --admin-socket with "
                                   f"--admin-socket or set {paths.ADMIN_SOCKET_ENV}", grpc.StatusCode.UNAVAILABLE)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(paths.grpc_target(self.socket))
        self._stub = admin_pb2_grpc.AdminStub(self._channel)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as e:
            err = from_rpc_error(e, self.socket, admin=True)
            if err.code == grpc.StatusCode.PERMISSION_DENIED:
                err.args = (f"permission denied on {self.socket}: the admin socket is root's only (use sudo)",)
            raise err from None

    def load_model(self, path: str = "", backend: str = "") -> pb.ModelInfo:
        return self._call(self._stub.LoadModel, admin_pb2.LoadModelRequest(path=path, backend=backend))

    def unload_model(self, timeout_seconds: float = 0) -> None:
        self._call(self._stub.UnloadModel, admin_pb2.UnloadModelRequest(timeout_seconds=timeout_seconds))

    def drain(self, timeout_seconds: float = 0) -> admin_pb2.DrainResponse:
        return self._call(self._stub.Drain, admin_pb2.DrainRequest(timeout_seconds=timeout_seconds))

    def resume(self) -> None:
        self._call(self._stub.Resume, admin_pb2.ResumeRequest())

    def shutdown(self, timeout_seconds: float = 0) -> None:
        self._call(self._stub.Shutdown, admin_pb2.ShutdownRequest(timeout_seconds=timeout_seconds))


__all__ = ["FIELD_METADATA", "MAX_CONSTRAINT_BYTES", "AdminClient", "AsyncClient", "Chunk", "Client", "Completion",
           "FieldError", "NtxError", "RequestTooLarge", "TokenLogprob", "chat_message", "check_constraint_size",
           "collect", "collect_async", "connection_error", "generate_request", "piece_text"]
