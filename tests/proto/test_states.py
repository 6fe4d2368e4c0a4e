"""ntx_proto.states holds the proto's state enums: the same names and numbers, words for people,
and a number it does not know read as UNSPECIFIED."""

import pytest

from ntx_proto.ntransformer.v1 import inference_pb2 as pb
from ntx_proto.states import RequestState, ServingState


@pytest.mark.parametrize("ours, theirs, prefix", [(ServingState, pb.ServingState, "SERVING_STATE_"),
                                                  (RequestState, pb.RequestState, "REQUEST_STATE_")])
def test_one_member_per_proto_value(ours, theirs, prefix):
    assert {prefix + m.name: m.value for m in ours} == dict(theirs.items())


def test_members_go_into_messages_and_come_back():
    r = pb.StatusResponse(state=ServingState.DRAINING, requests=[pb.RequestInfo(state=RequestState.PREFILL)])
    back = pb.StatusResponse.FromString(r.SerializeToString())
    assert ServingState(back.state) is ServingState.DRAINING and RequestState(back.requests[0].state) is RequestState.PREFILL


def test_words_and_unknown_numbers():
    assert [str(s) for s in ServingState] == ["unspecified", "no model", "loading", "serving", "draining", "failed"]
    assert f"{RequestState.DECODE}" == "decode"
    assert ServingState(99) is ServingState.UNSPECIFIED  # a newer daemon's state
