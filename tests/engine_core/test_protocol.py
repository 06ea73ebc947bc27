"""The wire types' own contracts: what a value becomes after a trip through msgpack."""

from __future__ import annotations

import msgspec
import pytest

from pagoda.engine_core import protocol
from pagoda.engine_core.protocol import FinishReason


def test_finish_reason_crosses_the_wire_as_its_string():
    stats = protocol.SchedulerStatsMessage(0, 0, 0.0, 0)
    frame = protocol.encoder.encode(
        protocol.StepOutputs([protocol.RequestDelta("a", [1], FinishReason.LENGTH)], stats, 0.0)
    )
    assert b"\xa6length" in frame  # the value itself, as msgpack's str
    reason = protocol.output_decoder.decode(frame).deltas[0].finish_reason
    assert reason is FinishReason.LENGTH
    assert reason == "length" and str(reason) == f"{reason}" == f"{reason}" == "length"
    assert msgspec.json.encode({"finish_reason": reason}) == b'{"finish_reason":"length"}'


def test_an_unknown_finish_reason_is_refused_on_decoding():
    frame = protocol.encoder.encode(
        protocol.GenerateOutputs([protocol.GenerateDelta("a", 0, "", b"", 1, 1, finish_reason="tired")])
    )
    with pytest.raises(msgspec.ValidationError, match=r"Invalid enum value .tired."):
        protocol.frontend_response_decoder.decode(frame)


def test_token_logprobs_unpack_into_the_sampled_token_and_the_top_k():
    packed = protocol.TokenLogprobs.pack([7, 3, 7, 9], [-0.5, -0.25, -0.5, -2.0])  # float32: exact here
    decoded = msgspec.msgpack.decode(protocol.encoder.encode(packed), type=protocol.TokenLogprobs)
    token = decoded.sampled_and_top()
    assert token == (7, -0.5, [3, 7, 9], [-0.25, -0.5, -2.0])
    assert (token.token_id, token.logprob, token.top_ids, token.top_logprobs) == tuple(token)
    assert type(token.token_id) is int and type(token.logprob) is float  # Python numbers, not numpy's
    assert protocol.TokenLogprobs.pack([5], [-1.0]).sampled_and_top() == (5, -1.0, [], [])  # logprobs=0
