"""The steps' tcp feed for ranks on other machines (engine_core/parallel/tcp_feed.py): every reader gets
every message, in order, and only a reader holding the launch's client key gets any."""

from __future__ import annotations

import pytest
import zmq

from pagoda.engine_core.parallel.tcp_feed import TcpFeedReader, TcpFeedSpec, TcpFeedWriter


def test_every_reader_gets_every_message_in_order():
    writer = TcpFeedWriter(2, "127.0.0.1")
    readers = [TcpFeedReader(spec) for spec in writer.specs]
    try:
        messages = [[b"step", str(i).encode(), memoryview(bytes(range(i % 7)))] for i in range(50)]
        for message in messages:
            writer.write(message, timeout_s=10)
            for reader in readers:
                assert bytes(reader.read(timeout_s=10)) == b"".join(message)
        with pytest.raises(TimeoutError):
            readers[0].read(timeout_s=0.05)
    finally:
        for reader in readers:
            reader.close()
        writer.close()


def test_a_reader_without_the_client_key_gets_nothing():
    writer = TcpFeedWriter(1, "127.0.0.1")
    public, secret = zmq.curve_keypair()
    (spec,) = writer.specs
    intruder = TcpFeedReader(TcpFeedSpec(spec.address, spec.server_public, public, secret))
    try:
        # Refused by the ZAP handler: no peer ever takes the message, so the writer times out.
        with pytest.raises(TimeoutError):
            writer.write([b"secret prompt tokens"], timeout_s=1.0)
        with pytest.raises(TimeoutError):
            intruder.read(timeout_s=0.2)
    finally:
        intruder.close()
        writer.close()
