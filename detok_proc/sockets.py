"""The tokenizer process's client-facing sockets: a ROUTER for ipc:// clients and, when the server is
exposed over tcp://, a second one with CURVE authentication. A client key is the socket's index byte
followed by the ZeroMQ identity, so an answer goes back on the socket its request came in on.

The context's authenticator (CURVE on tcp://) also admits the engines' link key when the engines connect
back over tcp (the Ray backend), so it is set up here for both.
"""

from __future__ import annotations

import contextlib
import os

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pagoda.engine_core import protocol
from pagoda.engine_core.zmq_security import CurveConfig, EngineLinkKeys


class FrontendSockets:
    def __init__(
        self,
        ctx: zmq.Context,
        frontend_addrs: list[str],
        tcp_addr: str | None,
        curve: CurveConfig | None,
        link_keys: EngineLinkKeys | None,
    ):
        self.ctx = ctx
        self.auth = None
        self.frontends = [self._router(frontend_addrs)]
        self.ipc_files = [addr[len("ipc://") :] for addr in frontend_addrs if addr.startswith("ipc://")]
        if tcp_addr is not None:
            if curve is None:
                raise ValueError("a tcp:// frontend needs CURVE keys")
            self.auth = curve.serve(self.ctx, router := self.ctx.socket(zmq.ROUTER))
            self.frontends.append(self._router([tcp_addr], router))
        if link_keys is not None:  # engines connect back over tcp: admit only their key
            if self.auth is None:
                self.auth = ThreadAuthenticator(self.ctx)
                self.auth.start()
            link_keys.authorize(self.auth)

    def _router(self, addrs: list[str], router: zmq.Socket | None = None) -> zmq.Socket:
        router = router or self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises, so its work is aborted
        router.setsockopt(zmq.SNDHWM, 0)  # never block the loop on one slow reader
        for addr in addrs:
            router.bind(addr)
        return router

    def send(self, client: bytes, message) -> None:
        """zmq.ZMQError (EHOSTUNREACH) when the client is gone."""
        self.frontends[client[0]].send_multipart([client[1:], protocol.encoder.encode(message)], copy=False)

    def client_prefix(self, socket: zmq.Socket) -> bytes:
        """What goes before a ZeroMQ identity received on `socket` to make the client's key."""
        return bytes([self.frontends.index(socket)])

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        for socket in self.frontends:
            socket.close(linger=0)

    def remove_ipc_files(self) -> None:
        """ZeroMQ leaves bound ipc socket files behind."""
        for path in self.ipc_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
