"""Stand-in for the shared-memory broadcast ring (engine_core/parallel/shm_ring.py, being written in
another branch), with its interface: one writer, N readers, every message to every reader in order.

It sends each message to each reader over its own ZeroMQ PUSH/PULL pair (ipc sockets in the given
runtime directory), so a reader that stops reading makes `write` time out naming it, as the ring does
when its slots are full. The executor imports `RingWriter`/`RingReader` from here until the ring lands.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence

import msgspec
import zmq


class RingSpec(msgspec.Struct, frozen=True):
    """What a reader needs to attach."""

    addresses: list[str]


class RingWriter:
    def __init__(self, num_readers: int, slot_bytes: int = 1 << 20, num_slots: int = 8, runtime_dir: str | None = None):
        self._own_dir = runtime_dir is None
        self._dir = runtime_dir or tempfile.mkdtemp(prefix="pagoda-ring-")
        self._ctx = zmq.Context()
        self._sockets = []
        tag = uuid.uuid4().hex[:8]
        self._paths = [os.path.join(self._dir, f"ring-{tag}-{i}.sock") for i in range(num_readers)]
        for path in self._paths:
            socket = self._ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, num_slots)
            socket.bind(f"ipc://{path}")
            self._sockets.append(socket)
        self.spec = RingSpec([f"ipc://{path}" for path in self._paths])

    def write(self, parts: Sequence[bytes | memoryview | bytearray], timeout_s: float | None = None) -> None:
        """Queue one message for every reader; TimeoutError naming a reader that takes none in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for index, socket in enumerate(self._sockets):
            while True:
                try:
                    socket.send_multipart(parts, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"ring reader {index} took no message for {timeout_s:.0f}s") from None
                    socket.poll(100 if left is None else max(1, min(100, int(left * 1000))), zmq.POLLOUT)

    def close(self) -> None:
        for socket in self._sockets:
            socket.close(linger=0)
        self._ctx.term()
        for path in self._paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class RingReader:
    def __init__(self, spec: RingSpec, index: int):
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.connect(spec.addresses[index])

    def read(self, timeout_s: float | None = None) -> bytes:
        """The next message; TimeoutError if none comes within `timeout_s`."""
        if not self._socket.poll(None if timeout_s is None else int(timeout_s * 1000)):
            raise TimeoutError(f"no ring message within {timeout_s}s")
        return b"".join(self._socket.recv_multipart())

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.term()
