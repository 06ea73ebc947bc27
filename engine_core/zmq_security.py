"""ZeroMQ CURVE authentication for a frontend socket exposed over tcp://.

Keys are ZeroMQ certificate files (`pagoda keys DIR` writes a server pair and a client pair). The
server loads its secret certificate and accepts only clients whose public certificates are in an
authorized-keys directory; a client needs the server's public certificate and its own secret one.
ipc:// sockets are protected by their 0700 runtime directory instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveConfig:
    server_secret_file: str  # the server's "*.key_secret" certificate
    authorized_keys_dir: str  # directory of clients' "*.key" public certificates

    def serve(self, ctx: zmq.Context, socket: zmq.Socket) -> ThreadAuthenticator:
        """Make `socket` (not yet bound) a CURVE server that admits only authorized clients."""
        authenticator = ThreadAuthenticator(ctx)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=self.authorized_keys_dir)
        public, secret = zmq.auth.load_certificate(self.server_secret_file)
        socket.curve_publickey, socket.curve_secretkey = public, secret
        socket.curve_server = True
        return authenticator


def connect_curve(socket: zmq.Socket, server_public_file: str, client_secret_file: str) -> None:
    """Make `socket` (not yet connected) a CURVE client of the server with that public certificate."""
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    public, secret = zmq.auth.load_certificate(client_secret_file)
    socket.curve_serverkey = server_public
    socket.curve_publickey, socket.curve_secretkey = public, secret


def generate_keys(directory: str | Path) -> dict[str, Path]:
    """Write server and client certificate pairs into `directory` (mode 0700), and authorize the
    client by copying its public certificate into `directory/authorized`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    server_public, server_secret = zmq.auth.create_certificates(str(directory), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(directory), "client")
    authorized = directory / "authorized"
    authorized.mkdir(exist_ok=True)
    (authorized / "client.key").write_bytes(Path(client_public).read_bytes())
    return {
        "server_public": Path(server_public),
        "server_secret": Path(server_secret),
        "client_public": Path(client_public),
        "client_secret": Path(client_secret),
        "authorized": authorized,
    }


ENGINE_LINK_DOMAIN = "pagoda-engine-link"  # the ZAP domain of the engine links (the frontend's is "*")


@dataclass(frozen=True)
class EngineLinkKeys:
    """Per-launch CURVE keys of the links between the tokenizer process and engines that connect back
    over tcp (the Ray backend, where an engine may run on another machine). The tokenizer process binds
    as the CURVE server and admits only the client key; the engines get the client pair and the
    server's public key in their constructor. Generated in memory for each launch, never written."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> EngineLinkKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def for_engine(self) -> EngineLinkKeys:
        """What an engine needs: no server secret."""
        return EngineLinkKeys(self.server_public, b"", self.client_public, self.client_secret)

    def authorize(self, authenticator: ThreadAuthenticator) -> None:
        """Admit the engines' client key (and no other) on ENGINE_LINK_DOMAIN."""
        authenticator.configure_curve_callback(ENGINE_LINK_DOMAIN, _OneKey(self.client_public))

    def make_server(self, socket: zmq.Socket) -> None:
        """`socket` (not yet bound) a CURVE server on ENGINE_LINK_DOMAIN (see `authorize`)."""
        socket.curve_publickey, socket.curve_secretkey = self.server_public, self.server_secret
        socket.curve_server = True
        socket.zap_domain = ENGINE_LINK_DOMAIN.encode()

    def make_client(self, socket: zmq.Socket) -> None:
        """`socket` (not yet connected) a CURVE client of the tokenizer process."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey, socket.curve_secretkey = self.client_public, self.client_secret


class _OneKey:
    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ENGINE_LINK_DOMAIN and key == self.key
