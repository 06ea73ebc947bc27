"""The wire types' own contracts: what a value becomes after a trip through msgpack."""

from __future__ import annotations

import msgspec
import pytest

from engine_core import protocol
from engine_core.protocol import FinishReason


def test_finish_reason_crosses_the_wire_as_its_string():
    stats = protocol.SchedulerStatsMessage(0, 0, 0.0, 0)
    frame = protocol.encoder.encode(protocol.StepOutputs([protocol.RequestDelta("a", [1], FinishReason.LENGTH)],
                                                         stats, 0.0))
    assert b"\xa6length" in frame  # the value itself, as msgpack's str
    reason = protocol.output_decoder.decode(frame).deltas[0].finish_reason
    assert reason is FinishReason.LENGTH
    assert reason == "length" and str(reason) == f"{reason}" == "%s" % reason == "length"
    assert msgspec.json.encode({"finish_reason": reason}) == b'{"finish_reason":"length"}'


def test_an_unknown_finish_reason_is_refused_on_decoding():
    frame = protocol.encoder.encode(protocol.GenerateOutputs([protocol.GenerateDelta(
        "a", 0, "", b"", 1, 1, finish_reason="tired")]))
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value .tired."):
        protocol.frontend_response_decoder.decode(frame)
