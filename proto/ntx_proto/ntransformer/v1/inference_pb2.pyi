from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]

class ServingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATE_UNSPECIFIED: _ClassVar[ServingState]
    SERVING_STATE_NO_MODEL: _ClassVar[ServingState]
    SERVING_STATE_LOADING: _ClassVar[ServingState]
    SERVING_STATE_SERVING: _ClassVar[ServingState]
    SERVING_STATE_DRAINING: _ClassVar[ServingState]
    SERVING_STATE_FAILED: _ClassVar[ServingState]

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_QUEUED: _ClassVar[RequestState]
    REQUEST_STATE_PREFILL: _ClassVar[RequestState]
    REQUEST_STATE_DECODE: _ClassVar[RequestState]
    REQUEST_STATE_DONE: _ClassVar[RequestState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
SERVING_STATE_UNSPECIFIED: ServingState
SERVING_STATE_NO_MODEL: ServingState
SERVING_STATE_LOADING: ServingState
SERVING_STATE_SERVING: ServingState
SERVING_STATE_DRAINING: ServingState
SERVING_STATE_FAILED: ServingState
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_QUEUED: RequestState
REQUEST_STATE_PREFILL: RequestState
REQUEST_STATE_DECODE: RequestState
REQUEST_STATE_DONE: RequestState

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "chat", "prompt_ids", "sampling", "max_tokens", "stop", "ignore_eos", "speculative", "no_prefix_cache", "constraint", "logprobs", "prompt_logprobs", "on_behalf_of")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    NO_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ON_BEHALF_OF_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    chat: Chat
    prompt_ids: TokenIds
    sampling: SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    speculative: str
    no_prefix_cache: bool
    constraint: Constraint
    logprobs: int
    prompt_logprobs: bool
    on_behalf_of: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., speculative: _Optional[str] = ..., no_prefix_cache: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., on_behalf_of: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "regex", "grammar", "max_digits")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MAX_DIGITS_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    grammar: str
    max_digits: int
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., max_digits: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("id", "piece", "logprob", "top", "special")
    ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    piece: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    special: bool
    def __init__(self, id: _Optional[int] = ..., piece: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., special: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "queue_seconds", "prefill_seconds", "decode_seconds", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "prompt_ids", "finish_reason", "usage", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "add_special", "parse_special")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: Chat
    add_special: bool
    parse_special: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., add_special: _Optional[bool] = ..., parse_special: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids", "pieces")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierPlan(_message.Message):
    __slots__ = ("tiers", "explanation")
    class Tier(_message.Message):
        __slots__ = ("name", "layers", "bytes")
        NAME_FIELD_NUMBER: _ClassVar[int]
        LAYERS_FIELD_NUMBER: _ClassVar[int]
        BYTES_FIELD_NUMBER: _ClassVar[int]
        name: str
        layers: int
        bytes: int
        def __init__(self, name: _Optional[str] = ..., layers: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierPlan.Tier]
    explanation: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierPlan.Tier, _Mapping]]] = ..., explanation: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "path", "architecture", "file_bytes", "n_layers", "context_length", "vocab_size", "backend", "has_chat_template", "plan", "metadata", "description", "aliases", "deterministic")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    architecture: str
    file_bytes: int
    n_layers: int
    context_length: int
    vocab_size: int
    backend: str
    has_chat_template: bool
    plan: TierPlan
    metadata: _containers.ScalarMap[str, str]
    description: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    deterministic: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., architecture: _Optional[str] = ..., file_bytes: _Optional[int] = ..., n_layers: _Optional[int] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., backend: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., plan: _Optional[_Union[TierPlan, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., description: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("id", "state", "slot", "prompt_tokens", "generated_tokens", "age_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    state: RequestState
    slot: int
    prompt_tokens: int
    generated_tokens: int
    age_seconds: float
    def __init__(self, id: _Optional[int] = ..., state: _Optional[_Union[RequestState, str]] = ..., slot: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("name", "layers", "bytes", "bytes_per_second", "source", "read_bytes", "read_seconds", "read_bytes_per_second", "reads", "read_errors", "commands", "commands_in_flight", "max_commands_in_flight", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    READ_ERRORS_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_COMMANDS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: int
    bytes: int
    bytes_per_second: float
    source: str
    read_bytes: int
    read_seconds: float
    read_bytes_per_second: float
    reads: int
    read_errors: int
    commands: int
    commands_in_flight: int
    max_commands_in_flight: int
    last_error: str
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[int] = ..., bytes: _Optional[int] = ..., bytes_per_second: _Optional[float] = ..., source: _Optional[str] = ..., read_bytes: _Optional[int] = ..., read_seconds: _Optional[float] = ..., read_bytes_per_second: _Optional[float] = ..., reads: _Optional[int] = ..., read_errors: _Optional[int] = ..., commands: _Optional[int] = ..., commands_in_flight: _Optional[int] = ..., max_commands_in_flight: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class SpeculationStatus(_message.Message):
    __slots__ = ("default_mode", "draft_model", "passes", "proposed", "accepted", "acceptance", "tokens_per_pass", "cost_table")
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_PASS_FIELD_NUMBER: _ClassVar[int]
    COST_TABLE_FIELD_NUMBER: _ClassVar[int]
    default_mode: str
    draft_model: str
    passes: int
    proposed: int
    accepted: int
    acceptance: float
    tokens_per_pass: float
    cost_table: str
    def __init__(self, default_mode: _Optional[str] = ..., draft_model: _Optional[str] = ..., passes: _Optional[int] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance: _Optional[float] = ..., tokens_per_pass: _Optional[float] = ..., cost_table: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("rows", "host_layers", "link_layers", "predicted_step_seconds", "measured_step_seconds", "steps")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HOST_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LINK_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    host_layers: _containers.RepeatedScalarFieldContainer[int]
    link_layers: int
    predicted_step_seconds: float
    measured_step_seconds: float
    steps: int
    def __init__(self, rows: _Optional[int] = ..., host_layers: _Optional[_Iterable[int]] = ..., link_layers: _Optional[int] = ..., predicted_step_seconds: _Optional[float] = ..., measured_step_seconds: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

class KVStatus(_message.Message):
    __slots__ = ("dtype", "bytes_per_token", "block_size", "blocks", "pool_bytes", "pool_tokens", "max_ctx", "used_blocks", "shared_blocks", "resident_layers", "resident_by_dtype", "spill_limit_bytes", "spilled_bytes", "spilled_blocks_total", "restored_blocks_total")
    class ResidentByDtypeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CTX_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPILL_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    bytes_per_token: int
    block_size: int
    blocks: int
    pool_bytes: int
    pool_tokens: int
    max_ctx: int
    used_blocks: int
    shared_blocks: int
    resident_layers: int
    resident_by_dtype: _containers.ScalarMap[str, int]
    spill_limit_bytes: int
    spilled_bytes: int
    spilled_blocks_total: int
    restored_blocks_total: int
    def __init__(self, dtype: _Optional[str] = ..., bytes_per_token: _Optional[int] = ..., block_size: _Optional[int] = ..., blocks: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., pool_tokens: _Optional[int] = ..., max_ctx: _Optional[int] = ..., used_blocks: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., resident_layers: _Optional[int] = ..., resident_by_dtype: _Optional[_Mapping[str, int]] = ..., spill_limit_bytes: _Optional[int] = ..., spilled_bytes: _Optional[int] = ..., spilled_blocks_total: _Optional[int] = ..., restored_blocks_total: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "load_progress", "load_fraction", "model", "backend", "live_requests", "queued_requests", "batch_size", "max_batch", "max_queue", "free_slots", "tokens_per_second", "tiers", "steps", "requests_total", "tokens_generated_total", "uptime_seconds", "memory_bytes", "requests", "error", "pid", "speculation", "skip_layers", "vram_bytes", "pinned_bytes", "prompt_tokens_total", "prefill_tokens_total", "prefix_hit_tokens_total", "prefix_evictions_total", "prefix_cached_slots", "prefix_cache", "prefix_cache_share", "placements", "kv")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    SKIP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    VRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SHARE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    state: ServingState
    load_progress: str
    load_fraction: float
    model: str
    backend: str
    live_requests: int
    queued_requests: int
    batch_size: int
    max_batch: int
    max_queue: int
    free_slots: int
    tokens_per_second: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    steps: int
    requests_total: int
    tokens_generated_total: int
    uptime_seconds: float
    memory_bytes: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    error: str
    pid: int
    speculation: SpeculationStatus
    skip_layers: _containers.RepeatedScalarFieldContainer[int]
    vram_bytes: int
    pinned_bytes: int
    prompt_tokens_total: int
    prefill_tokens_total: int
    prefix_hit_tokens_total: int
    prefix_evictions_total: int
    prefix_cached_slots: int
    prefix_cache: bool
    prefix_cache_share: str
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    kv: KVStatus
    def __init__(self, state: _Optional[_Union[ServingState, str]] = ..., load_progress: _Optional[str] = ..., load_fraction: _Optional[float] = ..., model: _Optional[str] = ..., backend: _Optional[str] = ..., live_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., batch_size: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_queue: _Optional[int] = ..., free_slots: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ..., steps: _Optional[int] = ..., requests_total: _Optional[int] = ..., tokens_generated_total: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ..., error: _Optional[str] = ..., pid: _Optional[int] = ..., speculation: _Optional[_Union[SpeculationStatus, _Mapping]] = ..., skip_layers: _Optional[_Iterable[int]] = ..., vram_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., prefill_tokens_total: _Optional[int] = ..., prefix_hit_tokens_total: _Optional[int] = ..., prefix_evictions_total: _Optional[int] = ..., prefix_cached_slots: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., prefix_cache_share: _Optional[str] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., kv: _Optional[_Union[KVStatus, _Mapping]] = ...) -> None: ...
