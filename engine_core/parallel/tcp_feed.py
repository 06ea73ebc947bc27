"""Steps for ranks on other machines: the broadcast ring's messages over ZeroMQ tcp, with CURVE.

The shared-memory ring (shm_ring.py) reaches only the ranks on rank 0's machine. Under the Ray backend
a pipeline stage may run on another node: each such rank gets a PUSH socket of its own on rank 0 (bound
to rank 0's node address), which it connects to with PULL. Every message goes to every remote reader,
in order. A reader `_HWM` messages behind blocks the writer, as a full ring does, until `timeout_s`.

The keys are generated per executor and handed to the ranks in their spec. Each socket admits only
that client key (a ZAP handler), so no other process on the network can read the steps (the prompts'
token ids) or take a share of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from pagoda.engine_core.zmq_security import EngineLinkKeys

_HWM = 8  # messages queued per reader before the writer waits (the shared-memory ring's slot count)
_LINGER_MS = 1000  # how long closing lets ZeroMQ deliver what is queued (the stop message)


class TcpFeedSpec(msgspec.Struct, frozen=True):
    """What a remote rank needs to receive the steps (msgspec-encodable: it travels in a WorkerSpec)."""

    address: str  # tcp://host:port of this reader's socket on rank 0
    server_public: bytes
    client_public: bytes
    client_secret: bytes


class TcpFeedWriter:
    """Rank 0's side: one socket per remote reader."""

    def __init__(self, num_readers: int, host: str):
        self._ctx = zmq.Context()
        keys = EngineLinkKeys.generate()
        self._authenticator: ThreadAuthenticator | None = ThreadAuthenticator(self._ctx)
        self._authenticator.start()
        keys.authorize(self._authenticator)
        self._sockets: list[zmq.Socket] = []
        self.specs: list[TcpFeedSpec] = []
        for _ in range(num_readers):
            socket = self._ctx.socket(zmq.PUSH)
            socket.sndhwm = _HWM
            socket.linger = _LINGER_MS
            keys.make_server(socket)
            port = socket.bind_to_random_port(f"tcp://{host}")
            self._sockets.append(socket)
            address = f"tcp://{host}:{port}"
            self.specs.append(TcpFeedSpec(address, keys.server_public, keys.client_public, keys.client_secret))

    def write(self, parts: Sequence[bytes | memoryview | bytearray], timeout_s: float | None = None) -> None:
        """Send one message (its parts joined into one frame) to every remote reader; TimeoutError if
        a reader has not taken the earlier ones (or never connected) within `timeout_s`."""
        frame = b"".join(parts)
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        for index, socket in enumerate(self._sockets):
            if not socket.poll(timeout_ms, zmq.POLLOUT):
                raise TimeoutError(f"remote rank reader {index} took no step for {timeout_s:g}s")
            socket.send(frame, copy=False)

    def close(self) -> None:
        for socket in self._sockets:
            socket.close()
        self._sockets = []
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._ctx.term()


class TcpFeedReader:
    """A remote rank's side: `read` as the ring reader's (a TimeoutError when nothing came in time)."""

    def __init__(self, spec: TcpFeedSpec):
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.rcvhwm = _HWM
        self._socket.linger = 0
        keys = EngineLinkKeys(spec.server_public, b"", spec.client_public, spec.client_secret)
        keys.make_client(self._socket)
        self._socket.connect(spec.address)

    def read(self, timeout_s: float | None = None) -> memoryview:
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not self._socket.poll(timeout_ms, zmq.POLLIN):
            raise TimeoutError("no step arrived")
        return self._socket.recv(copy=False).buffer

    def close(self) -> None:
        self._socket.close()
        self._ctx.term()
