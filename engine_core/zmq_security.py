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
