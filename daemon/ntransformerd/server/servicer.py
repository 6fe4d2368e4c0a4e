"""The gRPC face of the daemon: proto messages in, scheduler calls, proto messages out.

Every domain error becomes a gRPC status in one place, STATUS_CODES / abort(); nothing a client
sends reaches the engine unchecked, and an unexpected exception becomes INTERNAL, not a crash.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import json
import os
import re
import time

import grpc
from google.protobuf.message import DecodeError

from ntransformerd.engine.generation import constraints
from ntransformerd.engine.backends import BACKENDS
from ntransformerd.engine.runtime.report import EngineReport, KVReport
from ntransformerd.engine.generation.sampler import MAX_TOP_LOGPROBS, InvalidParameter, SamplingParams
from ntransformerd.engine.generation.speculative import Mode
from ntransformerd.server import errors
from ntransformerd.server.callers import Caller
from ntransformerd.server.scheduler import Scheduler, SchedulerStatus
from ntx_proto.ntransformer.v1 import admin_pb2, admin_pb2_grpc, inference_pb2 as pb, inference_pb2_grpc
from ntx_proto.wire import FIELD_METADATA, piece_text

log = logging.getLogger("ntransformerd")

STATUS_CODES: dict[type[BaseException], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotReady: grpc.StatusCode.FAILED_PRECONDITION,
    errors.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Draining: grpc.StatusCode.UNAVAILABLE,
    errors.ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.EngineFailed: grpc.StatusCode.INTERNAL,
    errors.ModelFault: grpc.StatusCode.INTERNAL,
    errors.StorageUnavailable: grpc.StatusCode.UNAVAILABLE,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,  # SamplingParams.validate, tokenizer, chat template
}
# A status message travels in gRPC metadata (16 KB at most): longer ones keep their start (the
# cause) and their end (the fix). Messages quote clients' values bounded (errors.shown); this
# is the last guard.
MAX_MESSAGE_CHARS = 2000
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "eos": pb.FINISH_REASON_EOS}
MAX_PROMPT_BYTES = 1 << 20
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "seed")  # GenerateRequest.sampling's; the others are the request's own
# A quantization suffix of a model file's name (llama.cpp's type names: Q4_K_M, IQ2_XS, BF16...)
QUANT_SUFFIX = re.compile(r"[._-](?:[it]?q[0-9]+(?:_[a-z0-9]+)*|bf16|f16|f32|fp16|fp32|mxfp4(?:_moe)?)$")


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message for an exception raised while serving a call."""
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls], bounded(str(exc))
    log.exception("unexpected error serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, bounded(f"internal error in ntransformerd ({type(exc).__name__}: {exc}); "
                                             "see its log (journalctl -u ntransformerd)")


def bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    head, tail = MAX_MESSAGE_CHARS * 2 // 3, MAX_MESSAGE_CHARS // 4
    return f"{message[:head]} … [{len(message) - head - tail} characters left out] … {message[-tail:]}"


def _abort(context, exc: BaseException):
    code, message = status_of(exc)
    if isinstance(exc, errors.InvalidRequest) and exc.field:
        context.set_trailing_metadata(((FIELD_METADATA, exc.field),))
    context.abort(code, message)


@contextlib.contextmanager
def _about(field: str):
    """Name `field` in the InvalidRequest raised inside that names none; a ValueError (the
    tokenizer's, the chat template's) becomes one."""
    try:
        yield
    except errors.InvalidRequest as e:
        e.field = e.field or field
        raise
    except ValueError as e:
        raise errors.InvalidRequest(str(e), field=field) from None


def _aborted(exc: BaseException, context) -> bool:
    """The call already ended: a gRPC error, or what context.abort raised (its code is set)."""
    return isinstance(exc, grpc.RpcError) or context.code() is not None


def rpc(method):
    """Unary handler: domain errors → abort with their status."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:  # noqa: BLE001
            if _aborted(e, context):
                raise
            _abort(context, e)
    return wrapper


def stream_rpc(method):
    """Server-streaming handler: the same, around the iteration."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as e:  # noqa: BLE001
            if _aborted(e, context):
                raise
            _abort(context, e)
    return wrapper


class _Undecodable:
    def __init__(self, error: Exception):
        self.error = error


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """A request that is not valid protobuf (e.g. a string field that is not UTF-8) gets
    INVALID_ARGUMENT instead of grpc's default INTERNAL "Exception deserializing request"."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer

        def safe(data: bytes):
            try:
                return deserialize(data)
            except (DecodeError, UnicodeDecodeError, ValueError) as e:
                return _Undecodable(e)

        def guard(behavior):
            if behavior is None:
                return None

            def checked(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"the request is not a valid {details.method} message (string fields must be "
                                  f"UTF-8): {request.error}")
                return behavior(request, context)
            return checked

        return handler._replace(request_deserializer=safe, unary_unary=guard(handler.unary_unary),
                                unary_stream=guard(handler.unary_stream))


def slug(text: str) -> str:
    """`text` as a model id: lower case, each run of characters other than [a-z0-9._-] one "-",
    starting with a letter or digit and ending without a separator."""
    return re.sub(r"^[^a-z0-9]+|[._-]+$", "", re.sub(r"[^a-z0-9._-]+", "-", text.lower()))


def _file_name(path: str) -> str | None:
    """The model file's name; None for a model without one (a staged model's memory image)."""
    return os.path.basename(path) if path and not path.startswith("/proc/") else None


def model_id(path: str, metadata) -> str:
    """What clients name the model by (proto ModelInfo.name): the file's stem as a slug, less a
    quantization suffix ("SmolLM2-135M-Instruct.Q4_1.gguf" → "smollm2-135m-instruct"); the GGUF's
    general.name as a slug where the file has no name."""
    name = _file_name(path)
    if name:
        stem = slug(name[:-5] if name.lower().endswith(".gguf") else name)
        return QUANT_SUFFIX.sub("", stem) or stem or "model"
    return slug(str(metadata.get("general.name") or "")) or "model"


def model_aliases(path: str, metadata) -> list[str]:
    """The model's other names (proto ModelInfo.aliases): the file's name and stem, general.name."""
    name = _file_name(path)
    names = [name, name[:-5] if name and name.lower().endswith(".gguf") else None, metadata.get("general.name")]
    own = model_id(path, metadata)
    return [n for n in dict.fromkeys(str(x) for x in names if x) if n != own]


def _check_model(name: str, scheduler: Scheduler) -> None:
    engine = scheduler.engine
    if not name or engine is None:
        return
    own = model_id(engine.model.path, engine.model.metadata)
    if name.casefold() not in {n.casefold() for n in (own, *model_aliases(engine.model.path, engine.model.metadata))}:
        raise errors.InvalidRequest(f"unknown model {errors.shown(name)}: this daemon serves {own!r} "
                                    "(ntx-client models); leave model empty for the loaded one", field="model")


def max_tokens_of(request: pb.GenerateRequest, engine, default: int) -> int:
    """The request's max_tokens, checked against the context length (proto GenerateRequest: one
    range and one message, as the scheduler's); unset: the daemon's default, at most that length."""
    n_ctx = engine.max_ctx if engine is not None else None  # no model: schedule() says not ready
    if not request.HasField("max_tokens"):
        return min(default, n_ctx or default)
    value = request.max_tokens
    if not 1 <= value <= (n_ctx or (1 << 31) - 1):
        limit = f"{n_ctx} (the context length)" if n_ctx else "the context length"
        raise errors.InvalidRequest(f"max_tokens {value} is out of range: use 1..{limit}", field="max_tokens")
    return value


def sampling_params(request: pb.GenerateRequest, max_tokens: int):
    """The engine's SamplingParams from a request; unset fields keep their defaults."""
    s = request.sampling
    kw = {f: getattr(s, f) for f in SAMPLING_FIELDS if s.HasField(f)}
    try:
        return SamplingParams(**kw, stop=tuple(request.stop), max_tokens=max_tokens,
                              ignore_eos=request.ignore_eos).validate()
    except InvalidParameter as e:
        field = f"sampling.{e.field}" if e.field in SAMPLING_FIELDS else e.field
        raise errors.InvalidRequest(f"bad sampling parameter: {e}", field=field) from None


def speculative_mode(text: str) -> Mode | None:
    """A request's speculative mode, parsed once here; None ("") for the daemon's default."""
    if not text:
        return None
    try:
        return Mode.parse(text)
    except ValueError as e:
        raise errors.InvalidRequest(str(e), field="speculative") from None


def constraint_of(request: pb.GenerateRequest, engine):
    """The request's compiled constraint (engine/generation/constraints.py), None without one; a schema,
    regex or grammar over MAX_CONSTRAINT_BYTES, or one the compiler refuses, is InvalidRequest
    naming the field and the limit, or with the compiler's message."""
    c = request.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        if c.HasField("max_digits"):
            raise errors.InvalidRequest("constraint.max_digits bounds the numbers of a constraint: give "
                                        "constraint.json_schema, regex or grammar with it", field="constraint.max_digits")
        return None
    size = len(getattr(c, kind).encode())
    if size > constraints.MAX_CONSTRAINT_BYTES:
        limit = constraints.MAX_CONSTRAINT_BYTES
        raise errors.InvalidRequest(f"constraint.{kind} is {size:,} bytes; the daemon takes at most {limit >> 20} MiB "
                                    f"({limit:,} bytes) of constraint text: shorten or simplify it",
                                    field=f"constraint.{kind}")
    max_digits = c.max_digits if c.HasField("max_digits") else None
    if max_digits is not None and not 0 <= max_digits <= constraints.MAX_DIGITS_LIMIT:
        raise errors.InvalidRequest(f"constraint.max_digits {max_digits} is out of range: use "
                                    f"1..{constraints.MAX_DIGITS_LIMIT}, or 0 for no bound", field="constraint.max_digits")
    if engine is None:
        raise errors.NotReady("no model is loaded: load one with the Admin LoadModel verb (as root)")
    try:
        compiler = constraints.compiler_for(engine.tokenizer, engine.cfg.vocab_size)
        return compiler.compile(kind, getattr(c, kind), max_digits=max_digits)
    except constraints.InvalidConstraint as e:
        raise errors.InvalidRequest(f"bad constraint: {e}", field=f"constraint.{kind}") from None


def logprobs_pb(tokenizer, entries) -> list[pb.TokenLogprob]:
    """scheduler.Output's (id, logprob, top ids, top logprobs) entries as TokenLogprob messages."""
    def one(i, lp, top=(), top_lp=()):
        return pb.TokenLogprob(id=int(i), piece=tokenizer.token_bytes(int(i)), logprob=float(lp),
                               top=[one(j, v) for j, v in zip(top, top_lp)], special=tokenizer.is_control(int(i)))
    return [one(*e) for e in entries]


def chat_of(chat: pb.Chat) -> dict:
    """A Chat as engine/generation/chat.py takes it (OpenAI's shapes): tokenize()'s messages= and tools=."""
    messages = []
    for m in chat.messages:
        d = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        messages.append(d)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               **({"parameters": t.parameters} if t.parameters else {})}}
             for t in chat.tools]
    return {"messages": messages, "tools": tools or None}


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """`identify`: context → callers.Caller, who sent a call (the server's callers.Identify)."""

    def __init__(self, *, scheduler: Scheduler, daemon, identify):
        self.scheduler = scheduler
        self.daemon = daemon
        self.identify = identify
        self._unnamed_warned = False

    def _caller(self, request, context) -> Caller | None:
        """Who sent `request`: the connection's identity, below it what the sender names in
        on_behalf_of. None for a peer the daemon cannot name: its request neither uses nor
        leaves anything in the prefix cache."""
        caller = self.identify(context)
        if caller is None:
            if not self._unnamed_warned:
                log.warning("cannot tell who peer %s is: its requests bypass the prefix cache", context.peer())
                self._unnamed_warned = True
            return None
        with _about("on_behalf_of"):
            return caller.below(request.on_behalf_of)

    def _prompt_ids(self, request) -> list[int]:
        which = request.WhichOneof("input")
        if which is None:
            raise errors.InvalidRequest("the request has no input: set prompt, chat or prompt_ids", field="prompt")
        with _about(which):
            if which == "prompt":
                if len(request.prompt) > MAX_PROMPT_BYTES:
                    raise errors.InvalidRequest(f"the prompt is over {MAX_PROMPT_BYTES} characters: shorten it")
                return self.scheduler.tokenize(text=request.prompt)
            if which == "chat":
                return self.scheduler.tokenize(**chat_of(request.chat))
            return self.scheduler.tokenize(ids=list(request.prompt_ids.ids))

    @stream_rpc
    def Generate(self, request: pb.GenerateRequest, context):
        _check_model(request.model, self.scheduler)
        engine = self.scheduler.engine
        max_tokens = max_tokens_of(request, engine, self.daemon.config.default_max_tokens)
        params = sampling_params(request, max_tokens)
        mode = speculative_mode(request.speculative)
        logprobs = request.logprobs if request.HasField("logprobs") else None
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise errors.InvalidRequest(f"logprobs {logprobs} is out of range: ask for 0..{MAX_TOP_LOGPROBS} "
                                        "alternatives per token", field="logprobs")
        caller = self._caller(request, context)
        prompt_ids = self._prompt_ids(request)
        constraint = constraint_of(request, engine)
        if mode is not None and engine is not None:
            with _about("speculative"):  # a mode this daemon cannot serve (no draft model)
                self.scheduler.speculator(mode)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None and remaining < 1e9 else None
        with _about(request.WhichOneof("input")):  # what is left to refuse is the prompt (empty, too long)
            req = self.scheduler.schedule(prompt_ids, params, max_tokens=max_tokens, deadline=deadline,
                                          prefix_cache=not request.no_prefix_cache and caller is not None,
                                          speculative=mode, logprobs=logprobs,
                                          prompt_logprobs=request.prompt_logprobs, constraint=constraint,
                                          caller=caller)
        context.add_callback(req.cancel)  # the client went away: the slot is freed next step
        tok = self.scheduler.engine.tokenizer  # the request's: an unload waits for it to finish
        # a message at most every stream_interval seconds (the first and the last at once), the
        # steps' tokens between as one: each message wakes the handler, gRPC's threads, the relay
        # and the client, on cores a step computing on the host needs (bench/cli_gap.py)
        for out in req.stream(interval=self.daemon.config.stream_interval):
            m = pb.GenerateResponse(text=out.text, token_ids=out.token_ids, prompt_ids=out.prompt_ids or ())
            if out.logprobs is not None:
                m.logprobs.extend(logprobs_pb(tok, out.logprobs))
            if out.prompt_logprobs is not None:
                m.prompt_logprobs.extend(logprobs_pb(tok, out.prompt_logprobs))
            if out.finish_reason:
                m.finish_reason = FINISH[out.finish_reason]
                m.usage.CopyFrom(pb.Usage(**out.usage))
            yield m

    @rpc
    def Tokenize(self, request: pb.TokenizeRequest, context):
        _check_model(request.model, self.scheduler)
        which = request.WhichOneof("input")
        add = request.add_special if request.HasField("add_special") else True
        parse = request.parse_special if request.HasField("parse_special") else True
        with _about(which or "text"):
            if which == "chat":
                ids = self.scheduler.tokenize(**chat_of(request.chat))
            else:
                ids = self.scheduler.tokenize(text=request.text, add_special=add, parse_special=parse)
        tok = self.scheduler.engine.tokenizer
        return pb.TokenizeResponse(ids=ids, pieces=[piece_text(tok.token_bytes(i)) for i in ids])

    @rpc
    def Detokenize(self, request: pb.DetokenizeRequest, context):
        _check_model(request.model, self.scheduler)
        with _about("ids"):
            ids = self.scheduler.tokenize(ids=list(request.ids))  # checks the range
        return pb.DetokenizeResponse(text=self.scheduler.engine.tokenizer.decode(ids))

    @rpc
    def GetModel(self, request, context):
        return model_info(self.scheduler.serving_engine(admitting=False))

    @rpc
    def Status(self, request, context):
        return status_response(self.scheduler, self.daemon, self.identify(context))


def model_info(engine, report: EngineReport | None = None) -> pb.ModelInfo:
    md, cfg = engine.model.metadata, engine.cfg
    report = report or engine.report()
    scalars = {k: str(v) for k, v in md.items()
               if isinstance(v, (str, int, float, bool)) and k != "tokenizer.chat_template" and len(str(v)) < 512}
    plan = pb.TierPlan(tiers=[pb.TierPlan.Tier(name=t.name, layers=t.layers, bytes=t.bytes) for t in report.tiers],
                       explanation=report.plan)
    return pb.ModelInfo(name=model_id(engine.model.path, md), aliases=model_aliases(engine.model.path, md),
                        path=engine.model.path, architecture=str(md.get("general.architecture", "")),
                        file_bytes=engine.model.file_size, n_layers=cfg.n_layers, context_length=engine.max_ctx,
                        vocab_size=cfg.vocab_size, backend=report.backend, deterministic=report.deterministic,
                        has_chat_template=bool(md.get("tokenizer.chat_template")), plan=plan, metadata=scalars,
                        description=f"{md.get('general.name', '')} {md.get('general.size_label', '')}".strip())


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _vram_bytes(report: EngineReport) -> int:
    """What CuPy's device pool holds on the cuda backend (every device allocation goes through
    it); 0 on the cpu backend."""
    if report.backend != "cuda":
        return 0
    import cupy  # lazy: optional (the [gpu] extra), here only on the cuda backend

    return int(cupy.get_default_memory_pool().total_bytes())


def status_response(scheduler: Scheduler, daemon, caller: Caller | None = None) -> pb.StatusResponse:
    """The daemon's state for `caller`, mapped from its typed figures in this one place. Counts
    and totals are the daemon's (the prefix counters too: no request hits another scope's cache,
    so they say how busy it is, not what anyone asked); the list of requests is the caller's
    own, all of them for root and the daemon's user."""
    s: SchedulerStatus = scheduler.status()
    life, cfg, engine = daemon.lifecycle.status(), daemon.config, scheduler.engine
    shown_requests = [q for q in s.requests
                      if caller is not None and (caller.privileged or _same_sender(q.caller, caller))]
    r = pb.StatusResponse(state=life.state, load_progress=life.progress, load_fraction=life.fraction, error=life.error,
                          live_requests=s.live, queued_requests=s.queued, batch_size=s.batch,
                          max_batch=cfg.max_batch, max_queue=cfg.max_queue, free_slots=s.free_slots,
                          tokens_per_second=s.tokens_per_second, steps=s.steps,
                          requests_total=s.requests_total, tokens_generated_total=s.tokens_total,
                          uptime_seconds=s.uptime, memory_bytes=_rss_bytes(), pid=os.getpid(),
                          requests=[pb.RequestInfo(id=q.id, state=q.state, slot=q.slot, prompt_tokens=q.prompt_tokens,
                                                   generated_tokens=q.generated_tokens, age_seconds=q.age_seconds)
                                    for q in shown_requests],
                          prompt_tokens_total=s.prompt_tokens_total, prefill_tokens_total=s.prefill_tokens_total,
                          prefix_hit_tokens_total=s.prefix_hit_tokens_total,
                          prefix_evictions_total=s.prefix_evictions_total,
                          prefix_cached_slots=s.prefix_cached_slots, prefix_cache=cfg.prefix_cache,
                          prefix_cache_share=cfg.prefix_cache_share)
    sp = s.speculation
    r.speculation.CopyFrom(pb.SpeculationStatus(
        default_mode=sp.default_mode, draft_model=sp.draft_model, passes=sp.passes, proposed=sp.proposed,
        accepted=sp.accepted, acceptance=sp.acceptance, tokens_per_pass=sp.tokens_per_pass,
        cost_table=json.dumps(sp.costs.to_dict()) if sp.costs is not None else ""))
    if engine is not None:
        report = engine.report()
        r.vram_bytes, r.pinned_bytes = _vram_bytes(report), report.pinned_bytes
        r.skip_layers.extend(report.skip_layers)
        r.kv.CopyFrom(_kv(report.kv))
        r.placements.extend(_placements(report))
        info = model_info(engine, report)
        r.model, r.backend = info.name, info.backend
        storage = daemon.models.storage_stats()
        for t in info.plan.tiers:  # each step reads every layer once
            tier = r.tiers.add(name=t.name, layers=t.layers, bytes=t.bytes,
                               bytes_per_second=t.bytes * s.steps_per_second)
            if t.name == "storage" and storage is not None:
                tier_counters(tier, storage)
    return r


def _same_sender(owner: Caller | None, caller: Caller) -> bool:
    """A request of `owner` is shown to `caller`: the same connection identity (a gateway sees
    the requests of all its keys; on_behalf_of does not hide them from their sender)."""
    return owner is not None and owner.principal == caller.principal


def kv_status(engine) -> pb.KVStatus:
    """The KV pool of the engine's (first) device and what its plan weighed: the layers resident
    with each KV type at that pool."""
    return _kv(engine.report().kv)


def _kv(kv: KVReport) -> pb.KVStatus:
    pool_tokens = kv.blocks * kv.block_size
    return pb.KVStatus(dtype=kv.dtype, bytes_per_token=kv.bytes_per_token, max_ctx=kv.max_ctx,
                       resident_layers=kv.resident_layers, resident_by_dtype=kv.resident_by_dtype,
                       block_size=kv.block_size, blocks=kv.blocks, pool_tokens=pool_tokens,
                       pool_bytes=pool_tokens * kv.bytes_per_token, used_blocks=kv.used_blocks,
                       shared_blocks=kv.shared_blocks, spill_limit_bytes=kv.spill_limit, spilled_bytes=kv.spilled_bytes,
                       spilled_blocks_total=kv.spilled_blocks_total, restored_blocks_total=kv.restored_blocks_total)


def placements(engine) -> list[pb.Placement]:
    """Where the layers run at each step shape of a plan with the host computing beside the GPU:
    the prediction of the placement now (it follows the steps) and the steps measured since the
    load. Empty for other plans."""
    return _placements(engine.report())


def _placements(report: EngineReport) -> list[pb.Placement]:
    return [pb.Placement(rows=p.rows, host_layers=p.host_layers, link_layers=p.link_layers,
                         predicted_step_seconds=p.predicted_seconds, measured_step_seconds=p.measured_seconds,
                         steps=p.steps) for p in report.placements]


def tier_counters(tier: pb.TierStatus, st: dict) -> None:
    """The storage source's counters (storage.StorageHandle.stats) into a TierStatus."""
    tier.source, tier.read_bytes, tier.read_seconds = st["source"], st["bytes"], st["seconds"]
    tier.read_bytes_per_second = st["bytes"] / st["seconds"] if st["seconds"] > 0 else 0.0
    tier.reads, tier.read_errors, tier.last_error = st["reads"], st["errors"], st["last_error"]
    tier.commands, tier.commands_in_flight = st["commands"], st["in_flight"]
    tier.max_commands_in_flight = st["max_in_flight"]


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, *, daemon):
        self.daemon = daemon

    @rpc
    def LoadModel(self, request, context):
        if request.backend and request.backend not in BACKENDS:
            raise errors.InvalidRequest(f"backend {errors.shown(request.backend)}: use {', '.join(BACKENDS)}")
        if request.path and not os.path.isfile(request.path):
            raise errors.InvalidRequest(f"no model file at {errors.shown(request.path, 300)}: give the path of a "
                                        ".gguf file")
        return model_info(self.daemon.models.load(request.path or None, request.backend or None))

    @rpc
    def UnloadModel(self, request, context):
        self.daemon.models.unload(request.timeout_seconds or self.daemon.config.drain_timeout)
        return admin_pb2.UnloadModelResponse()

    @rpc
    def Drain(self, request, context):
        finished, cancelled = self.daemon.drain(request.timeout_seconds or self.daemon.config.drain_timeout,
                                                reason="ntransformerd is draining (admin)")
        return admin_pb2.DrainResponse(finished=finished, cancelled=cancelled)

    @rpc
    def Resume(self, request, context):
        self.daemon.resume()
        return admin_pb2.ResumeResponse()

    @rpc
    def Shutdown(self, request, context):
        self.daemon.request_shutdown(request.timeout_seconds or None)
        return admin_pb2.ShutdownResponse()
