"""Every bad request gets the right status code and a message a person can act on; nothing a
client sends takes the daemon down (a table, then a hypothesis fuzz)."""

from __future__ import annotations

import math

import grpc
import pytest

from ntx_proto.ntransformer.v1 import inference_pb2 as pb, inference_pb2_grpc

IA = grpc.StatusCode.INVALID_ARGUMENT
GEN = "/ntransformer.v1.Inference/Generate"


def req(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    r = pb.GenerateRequest(**kw)
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


def _raw_prompt(data: bytes) -> bytes:
    """A GenerateRequest whose prompt (field 2, a proto3 string) holds `data`, UTF-8 or not."""
    return bytes([0x12, len(data)]) + data + bytes([0x30, 2])  # + max_tokens = 2


BAD = [  # (name, request or raw bytes, code, words the message must contain)
    ("NaN temperature", req(prompt="hi", sampling={"temperature": math.nan}), IA, "temperature"),
    ("infinite temperature", req(prompt="hi", sampling={"temperature": math.inf}), IA, "temperature"),
    ("negative temperature", req(prompt="hi", sampling={"temperature": -1.0}), IA, "temperature"),
    ("negative max_tokens", req(prompt="hi", max_tokens=-5), IA, "max_tokens"),
    ("zero max_tokens", req(prompt="hi", max_tokens=0), IA, "max_tokens"),
    ("huge max_tokens", req(prompt="hi", max_tokens=10**12), IA, "max_tokens"),
    ("max_tokens past the context", req(prompt="hi", max_tokens=100_000), IA, "context"),
    ("top_p zero", req(prompt="hi", sampling={"top_p": 0.0}), IA, "top_p"),
    ("top_p above one", req(prompt="hi", sampling={"top_p": 1.5}), IA, "top_p"),
    ("negative min_p", req(prompt="hi", sampling={"min_p": -0.1}), IA, "min_p"),
    ("negative top_k", req(prompt="hi", sampling={"top_k": -1}), IA, "top_k"),
    ("zero repetition penalty", req(prompt="hi", sampling={"repetition_penalty": 0.0}), IA, "repetition_penalty"),
    ("frequency penalty out of range", req(prompt="hi", sampling={"frequency_penalty": 5.0}), IA, "frequency_penalty"),
    ("unknown model", req(prompt="hi", model="llama-3-405b"), IA, "unknown model"),
    ("no input", pb.GenerateRequest(max_tokens=2), IA, "no input"),
    ("empty prompt", req(prompt="", max_tokens=2), IA, "empty"),
    ("token id past the vocabulary", req(prompt_ids=pb.TokenIds(ids=[1, 10**9]), max_tokens=2), IA, "out of range"),
    ("negative token id", req(prompt_ids=pb.TokenIds(ids=[-3]), max_tokens=2), IA, "out of range"),
    ("unknown chat role", req(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")]), max_tokens=2),
     IA, "role"),
    ("chat without messages", req(chat=pb.Chat(), max_tokens=2), IA, "no messages"),
    ("empty stop string", req(prompt="hi", stop=[""], max_tokens=2), IA, "stop"),
    ("prompt longer than the context", req(prompt="word " * 3000, max_tokens=2), IA, "context"),
    ("invalid UTF-8 prompt", _raw_prompt(b"ab\xff\xfecd"), IA, "UTF-8"),
    ("not protobuf at all", b"\xff\xff\xff\xff", IA, "not a valid"),
    ("a skip count past the model's layers", req(prompt="hi", speculative="skip:999", max_tokens=2), IA,
     "one number is how many layers to skip"),
    ("a skip count without a calibration", req(prompt="hi", speculative="skip:5", max_tokens=2), IA,
     "ntx-model calibrate-skip"),
    ("a prefix length in other digits", req(prompt="hi", speculative="prefix:²", max_tokens=2), IA,
     "digits 0-9"),
    ("a 3 MB chat message", req(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="word " * 600_000)]),
                                max_tokens=2), IA, "shorten or split it"),
]

HUGE = "x" * 20_000
ECHOES = [  # requests carrying 20,000 characters where a short word belongs
    ("speculative mode", req(prompt="hi", speculative=HUGE, max_tokens=2), "20000 characters is none"),
    ("model name", req(prompt="hi", model=HUGE, max_tokens=2), "unknown model"),
    ("chat role", req(chat=pb.Chat(messages=[pb.ChatMessage(role=HUGE, content="x")]), max_tokens=2), "chat role"),
]


@pytest.mark.parametrize("name,request_,words", ECHOES, ids=[e[0] for e in ECHOES])
def test_errors_never_echo_more_than_a_bounded_prefix_of_the_input(channel, name, request_, words):
    with pytest.raises(grpc.RpcError) as e:
        _generate(channel, request_)
    assert e.value.code() == IA and words in e.value.details(), e.value.details()[:300]
    assert len(e.value.details()) < 400, e.value.details()[:300]


@pytest.fixture(scope="module")
def channel(daemon):
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        yield ch


def _generate(channel, request, timeout=60):
    if isinstance(request, bytes):
        call = channel.unary_stream(GEN, request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
    else:
        call = inference_pb2_grpc.InferenceStub(channel).Generate
    return list(call(request, timeout=timeout))


@pytest.mark.parametrize("name,request_,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status(channel, name, request_, code, words):
    with pytest.raises(grpc.RpcError) as e:
        _generate(channel, request_)
    assert e.value.code() == code, e.value.details()
    assert words.lower() in e.value.details().lower(), e.value.details()


def test_bad_inputs_table_is_big_enough():
    assert len(BAD) >= 15


def test_tokenize_and_detokenize_errors(channel):
    stub = inference_pb2_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Detokenize(pb.DetokenizeRequest(ids=[10**9]))
    assert e.value.code() == IA and "out of range" in e.value.details()
    raw = channel.unary_unary("/ntransformer.v1.Inference/Tokenize", request_serializer=lambda b: b,
                              response_deserializer=pb.TokenizeResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        raw(bytes([0x12, 2, 0xc3, 0x28]))  # text = an invalid 2-byte sequence
    assert e.value.code() == IA


def test_a_tiny_deadline_is_deadline_exceeded(channel):
    with pytest.raises(grpc.RpcError) as e:
        _generate(channel, req(prompt="Count to a hundred:", max_tokens=200, ignore_eos=True), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_fuzzed_requests_leave_the_daemon_serving(channel, daemon):
    hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis (the test extra)")
    st = hypothesis.strategies
    OK_CODES = {IA, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
    floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
    sampling = st.fixed_dictionaries({}, optional={
        "temperature": floats, "top_k": st.integers(-2**63, 2**63 - 1), "top_p": floats, "min_p": floats,
        "repetition_penalty": floats, "frequency_penalty": floats, "presence_penalty": floats,
        "seed": st.integers(0, 2**64 - 1)})
    inputs = st.one_of(
        st.builds(lambda t: {"prompt": t}, st.text(max_size=200)),
        st.builds(lambda ids: {"prompt_ids": pb.TokenIds(ids=ids)}, st.lists(st.integers(-2**63, 2**63 - 1), max_size=20)),
        st.builds(lambda ms: {"chat": pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in ms])},
                  st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "x", ""]), st.text(max_size=50)),
                           max_size=3)),
        st.just({}))

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
    @hypothesis.given(inputs, sampling, st.integers(-5, 3), st.lists(st.text(max_size=5), max_size=3),
                      st.booleans(), st.sampled_from(["", "nope"]))
    def fuzz(inp, samp, max_tokens, stop, ignore_eos, model):
        r = pb.GenerateRequest(**inp, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, model=model)
        for k, v in samp.items():
            setattr(r.sampling, k, v)
        try:
            _generate(channel, r, timeout=60)
        except grpc.RpcError as e:
            assert e.code() in OK_CODES, (e.code(), e.details(), r)

    fuzz()

    @hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
    @hypothesis.given(st.binary(max_size=64))
    def fuzz_bytes(data):
        try:
            _generate(channel, data, timeout=60)
        except grpc.RpcError as e:
            assert e.code() in OK_CODES, (e.code(), e.details(), data)

    fuzz_bytes()
    assert daemon.proc.poll() is None
    from ntx_client import Client
    with Client(daemon.socket) as c:
        assert c.health() == "SERVING"


def test_model_info_reports_the_engine_tier_plan(default_model):
    """With a layer cap the CPU engine streams; GetModel/Status show the planner's tiers."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    from ntransformerd.server.servicer import model_info

    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=1, max_ctx=64, max_vram_layers=10))
    plan = model_info(e).plan
    tiers = {t.name: t.layers for t in plan.tiers}
    assert tiers.get("resident") == 10 and sum(tiers.values()) == 30, tiers
    assert "plan for 30 layers" in plan.explanation
