"""The servicer's face to clients (a real daemon on the default model): the model's id and the
names it answers to, one range and one message for max_tokens, the field an INVALID_ARGUMENT is
about, token text as OpenAI shows it, the constraint's bound on digits, and a request's state in
Status as the proto's enum."""

from __future__ import annotations

import re
import time

import grpc
import pytest

from ntransformerd.server import servicer
from ntx_client import Client
from ntx_client.client import FIELD_METADATA, FieldError
from ntx_proto.paths import grpc_target
from ntx_proto.ntransformer.v1 import inference_pb2 as pb, inference_pb2_grpc
from ntx_proto.states import RequestState

ID = re.compile(r"[a-z0-9][a-z0-9._-]*")
CTX = 1024  # the session daemon's --max-ctx
CJK_EMOJI = "日本語の文章を書いてください 😀🎉🧑‍🚀 naïve café"


@pytest.fixture(scope="module")
def stub(daemon):
    channel = grpc.insecure_channel(grpc_target(daemon.socket))
    yield inference_pb2_grpc.InferenceStub(channel)
    channel.close()


def _refusal(stub, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, message, the field named in the trailing metadata) of a refused Generate."""
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=60))
    field = dict(e.value.trailing_metadata() or ()).get(FIELD_METADATA)
    return e.value.code(), e.value.details(), field


@pytest.mark.parametrize("path, metadata, want", [
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", {}, "smollm2-135m-instruct"),
    ("/m/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", {}, "meta-llama-3.1-8b-instruct"),
    ("/m/Qwen2.5 7B (chat) IQ2_XS.GGUF", {}, "qwen2.5-7b-chat"),
    ("/m/tiny-q8_0.gguf", {}, "tiny"),
    ("/m/q4_0.gguf", {}, "q4_0"),  # nothing but the type: the type is the name
    ("/m/__.gguf", {}, "model"),
    ("/proc/self/fd/7", {"general.name": "Synthetic Llama 70B"}, "synthetic-llama-70b"),  # a staged model's image
])
def test_model_ids_are_slugs_of_the_file_name(path, metadata, want):
    got = servicer.model_id(path, metadata)
    assert got == want and ID.fullmatch(got)


def test_the_model_has_a_slug_id_and_answers_to_its_file_names(daemon):
    with Client(daemon.socket, timeout=120) as c:
        info = c.model()
        assert info.name == "smollm2-135m-instruct" and ID.fullmatch(info.name)
        general = info.metadata["general.name"]
        assert list(info.aliases) == ["SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1", general]
        assert c.status().model == info.name
        for name in (info.name, info.name.upper(), *info.aliases, "smollm2-135m-instruct.q4_1"):
            assert c.complete("Hi", model=name, max_tokens=1, temperature=0).ids, name
        with pytest.raises(FieldError, match="unknown model 'gpt-4o': this daemon serves 'smollm2-135m-instruct'") as e:
            c.complete("Hi", model="gpt-4o", max_tokens=1)
        assert e.value.field == "model"


def test_model_info_says_whether_the_engine_is_deterministic(synth_model):
    """EngineConfig.deterministic → EngineReport → ModelInfo.deterministic (the daemon's Status)."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    for on in (False, True):
        e = Engine.load(synth_model("tiny", "q8_0"), config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=64,
                                                                         deterministic=on))
        assert e.report().deterministic is on and servicer.model_info(e).deterministic is on


@pytest.mark.parametrize("value", [-1, 0, CTX + 1, 1 << 31, (1 << 63) - 1])
def test_max_tokens_has_one_range_and_one_message(stub, daemon, value):
    code, message, field = _refusal(stub, pb.GenerateRequest(prompt="Hi", max_tokens=value))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field == "max_tokens"
    assert message == f"max_tokens {value} is out of range: use 1..{CTX} (the context length)"
    if value > 0:  # the client library sends what it can encode; the daemon's words come back
        with Client(daemon.socket, timeout=60) as c, pytest.raises(FieldError) as e:
            c.complete("Hi", max_tokens=value)
        assert e.value.field == "max_tokens" and str(e.value).endswith(message)


def test_a_request_without_max_tokens_gets_the_default_within_the_context(new_daemon):
    d = new_daemon("--max-ctx", "64", "--max-batch", "2")  # the default max_tokens (512) is past this context
    try:
        with Client(d.wait_ready().socket, timeout=120) as c:
            done = c.complete("Count: 1, 2, 3,", temperature=0, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.prompt_ids) + len(done.ids) <= 65
    finally:
        d.cleanup()


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(prompt="hi", max_tokens=2, sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="hi", max_tokens=2, stop=[""]), "stop"),
    (pb.GenerateRequest(prompt="hi", max_tokens=2, speculative="warp"), "speculative"),
    (pb.GenerateRequest(prompt="hi", max_tokens=2, logprobs=21), "logprobs"),
    (pb.GenerateRequest(prompt="hi", max_tokens=2, constraint=pb.Constraint(json_schema='{"type": "nope"}')),
     "constraint.json_schema"),
    (pb.GenerateRequest(prompt="hi", max_tokens=2, constraint=pb.Constraint(regex="[0-9]+", max_digits=5000)),
     "constraint.max_digits"),
    (pb.GenerateRequest(prompt="hi", max_tokens=2, constraint=pb.Constraint(max_digits=8)), "constraint.max_digits"),
    (pb.GenerateRequest(prompt="word " * 3000, max_tokens=2), "prompt"),
    (pb.GenerateRequest(prompt="", max_tokens=2), "prompt"),
    (pb.GenerateRequest(prompt_ids=pb.TokenIds(ids=[10 ** 9]), max_tokens=2), "prompt_ids"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")]), max_tokens=2), "chat"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="tool", content="x", tool_call_id="c9")]),
                        max_tokens=2), "chat"),
    (pb.GenerateRequest(prompt="hi", max_tokens=2, model="nope"), "model"),
])
def test_an_invalid_argument_names_its_field(stub, request_, field):
    code, message, got = _refusal(stub, request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and got == field, message


def _piece_bytes(piece: str) -> bytes:
    """A token's bytes back from its text (OpenAI's convention: "bytes:\\xe6\\x97" for a part)."""
    if piece.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", piece))
    return piece.encode()


def test_status_lists_a_decoding_request_by_its_state(stub):
    """A request that has streamed a token is DECODE in its sender's Status (RequestInfo.state,
    the proto's RequestState)."""
    stream = stub.Generate(pb.GenerateRequest(prompt="Count to a thousand:", max_tokens=CTX // 2, ignore_eos=True,
                                              sampling=pb.SamplingParams(temperature=0)), timeout=300)
    try:
        next(stream)
        (info,) = stub.Status(pb.StatusRequest(), timeout=60).requests
        assert info.state == pb.REQUEST_STATE_DECODE and str(RequestState(info.state)) == "decode"
    finally:
        stream.cancel()


def test_token_text_shows_a_part_of_a_character_as_its_bytes(stub):
    r = stub.Tokenize(pb.TokenizeRequest(text=CJK_EMOJI, add_special=False), timeout=60)
    assert any(p.startswith("bytes:") for p in r.pieces)  # the vocabulary splits some of these characters
    assert not any("\ufffd" in p for p in r.pieces)
    assert b"".join(_piece_bytes(p) for p in r.pieces) == CJK_EMOJI.encode()


def _is_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_logprob_pieces_join_to_the_text_and_mark_the_end_token(daemon):
    """The reply is forced: a grammar of CJK_EMOJI and then the model's end token, so it holds these
    characters and ends with that token whatever the CPU's rounding makes of a free greedy answer
    (the constraint allows one token at each step). The vocabulary has no token for 日, 語 or 😀
    whole, so some tokens carry part of a character, and only their bytes joined give the text."""
    with Client(daemon.socket, timeout=300) as c:
        done = c.complete(messages=[{"role": "user", "content": f"Repeat exactly: {CJK_EMOJI}"}], max_tokens=120,
                          temperature=0, logprobs=3, grammar=f'start: "{CJK_EMOJI}" <|im_end|>')
    assert done.finish_reason == "eos" and done.text == CJK_EMOJI, done.text
    *text, end = done.logprobs
    assert end.special and end.piece == b"<|im_end|>" and not any(t.special for t in text)
    assert b"".join(t.piece for t in text) == done.text.encode()
    assert any(not _is_utf8(t.piece) for t in text)  # a character split across tokens
    assert all(len(t.top) == 3 and all(a.piece for a in t.top) for t in done.logprobs)


def test_a_json_number_has_at_most_16_digits_unless_asked(daemon):
    kw = dict(messages=[{"role": "user", "content": "Write a very long number."}], json_schema={"type": "integer"},
              max_tokens=40, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    with Client(daemon.socket, timeout=300) as c:
        for seed in range(2):
            done = c.complete(seed=seed, **kw)
            assert done.finish_reason in ("stop", "eos") and 1 <= len(done.text.lstrip("-")) <= 16, done.text
        longer = [c.complete(seed=seed, max_digits=0, **kw).text for seed in range(2)]
    assert max(len(t) for t in longer) > 16  # the same request without the bound runs on


def test_stream_interval_sets_how_often_a_stream_sends(new_daemon):
    """--stream-interval 1 (its most): a stream's first message goes at once and then at most one a
    second, so 48 tokens come in at most 2 + (seconds taken) messages, the same tokens as a
    daemon sending a message a step (0) sends; the default's 0.02 s would send many more."""
    def stream(d) -> tuple[list[list[int]], float]:
        with grpc.insecure_channel(grpc_target(d.socket)) as channel:
            t0 = time.monotonic()
            msgs = [list(m.token_ids) for m in inference_pb2_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(prompt="Once upon a time", max_tokens=48, ignore_eos=True,
                                   sampling=pb.SamplingParams(temperature=0)), timeout=120)]
            return [m for m in msgs if m], time.monotonic() - t0

    slow, fast = new_daemon("--stream-interval", "1"), new_daemon("--stream-interval", "0")
    try:
        slow.wait_ready(), fast.wait_ready()
        (few, took), (many, _) = stream(slow), stream(fast)
    finally:
        slow.cleanup(), fast.cleanup()
    assert sum(few, []) == sum(many, []) and len(sum(few, [])) == 48
    assert len(few) <= 2 + int(took), (len(few), took)
