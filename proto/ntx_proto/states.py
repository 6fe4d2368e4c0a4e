"""The proto's state enums as Python enums: one member per proto value, with the proto's number.

The daemon keeps its serving state and each request's state as these members, writes them into
messages as they are (they are ints), and logs them as words; a client reads a message's number
back with `ServingState(number)`. A number this package does not know (a newer daemon's) reads as
UNSPECIFIED instead of raising. tests/proto/test_states.py holds them to the .proto.

Thread rule: constants.
"""

from __future__ import annotations

import enum

from ntx_proto.ntransformer.v1 import inference_pb2 as pb


class _ProtoState(enum.IntEnum):
    @classmethod
    def _missing_(cls, value):
        return cls(0)  # UNSPECIFIED

    def __str__(self) -> str:
        """The state as a word for people and logs: "no model", "serving", "prefill"."""
        return self.name.lower().replace("_", " ")


class ServingState(_ProtoState):
    """StatusResponse.state: the daemon's serving state (server/lifecycle.py changes it)."""

    UNSPECIFIED = pb.SERVING_STATE_UNSPECIFIED
    NO_MODEL = pb.SERVING_STATE_NO_MODEL
    LOADING = pb.SERVING_STATE_LOADING
    SERVING = pb.SERVING_STATE_SERVING
    DRAINING = pb.SERVING_STATE_DRAINING
    FAILED = pb.SERVING_STATE_FAILED


class RequestState(_ProtoState):
    """RequestInfo.state: where a request stands in the scheduler."""

    UNSPECIFIED = pb.REQUEST_STATE_UNSPECIFIED
    QUEUED = pb.REQUEST_STATE_QUEUED
    PREFILL = pb.REQUEST_STATE_PREFILL
    DECODE = pb.REQUEST_STATE_DECODE
    DONE = pb.REQUEST_STATE_DONE


__all__ = ["RequestState", "ServingState"]
