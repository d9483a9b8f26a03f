"""The mutual challenge that opens every connection: both sides prove they hold the actor's key.

The key is one the actor makes at start and hands out only through Ray (it never crosses the
socket)::

    server -> client   MAGIC + Ns                  (a fresh 32-byte nonce)
    client -> server   Nc + HMAC(key, "<MAGIC> client" + Ns + Nc + "host:port")
    server -> client        HMAC(key, "<MAGIC> server" + Ns + Nc + "host:port")

Each side checks the other's proof (``hmac.compare_digest``) and hangs up on a wrong one; a
client raises ``PermissionError``. Both nonces make a proof good for one connection only, the
role label keeps one side's proof from passing as the other's, and the endpoint the client
dialed (the one the actor handed out) binds it to that address: an impostor on a port a
restarted actor freed cannot relay the handshake to the actor's new port.

Before the peer is authenticated, each frame must be a handshake message's exact size, and the
whole challenge must end within ``HANDSHAKE_TIMEOUT_S`` on the client's side, so a dead or wedged
actor makes a call fail instead of hang; the server gives a peer less
(``server.UNAUTHENTICATED_S``), so one that only holds a connection open soon gives its slot back.
``challenge`` is the server's half, ``answer`` the client's; the sockets (and TLS around them) are
the server's and the client's to set up.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from kvstore.fastcall.frames import FastConnection

#: (host, port, authkey) of a serving actor.
Endpoint = tuple[str, int, bytes]

#: A client must finish the key handshake (its dial) within this long, so a dead or wedged
#: actor makes a call fail instead of hang.
HANDSHAKE_TIMEOUT_S = 2.0
MAGIC = b"kvstore.fastcall.v2"
_NONCE = 32
_PROOF = 32  # HMAC-SHA256
_HELLO = len(MAGIC) + _NONCE
_ANSWER = _NONCE + _PROOF


def proof(key: bytes, role: bytes, nonces: tuple[bytes, bytes], host: str, port: int) -> bytes:
    """One side's proof that it holds ``key``, for this connection (``nonces``: the server's,
    the client's) to this endpoint only."""
    binding = f"{host}:{port}".encode()
    return hmac.new(key, b"".join((MAGIC, b" ", role, *nonces, binding)), hashlib.sha256).digest()


def challenge(conn: FastConnection, endpoint: Endpoint, deadline: float) -> bool:
    """The server's half on a fresh connection: True when the peer proved it holds the key of
    ``endpoint`` (it then has the server's proof), False when it did not (hang up). Raises what
    the connection raises (``OSError``, ``EOFError``, ``WireError`` for a frame of the wrong
    size) when the peer goes, misbehaves or passes ``deadline``."""
    host, port, authkey = endpoint
    server_nonce = os.urandom(_NONCE)
    conn.send_frame([MAGIC + server_nonce], deadline)
    answer = conn.recv_frame(_ANSWER, deadline)
    nonces = (server_nonce, bytes(answer[:_NONCE]))
    if not hmac.compare_digest(
        bytes(answer[_NONCE:]), proof(authkey, b"client", nonces, host, port)
    ):
        return False
    conn.send_frame([proof(authkey, b"server", nonces, host, port)], deadline)
    return True


def answer(conn: FastConnection, endpoint: Endpoint, deadline: float) -> None:
    """The client's half on a fresh connection to ``endpoint``; returns once both sides are
    proven. Raises ``ConnectionError`` when the server turned the connection away (busy),
    ``PermissionError`` when it refused the key or could not prove it holds it (not the actor),
    ``WireError`` for a handshake frame of the wrong size, and what the connection raises."""
    host, port, authkey = endpoint
    try:
        hello = conn.recv_frame(_HELLO, deadline)
    except EOFError:
        raise ConnectionError(f"fastcall: {host}:{port} turned the connection away") from None
    if len(hello) != _HELLO or not hello.startswith(MAGIC):
        raise PermissionError(f"fastcall: {host}:{port} is not a fastcall server")
    nonces = (bytes(hello[len(MAGIC) :]), os.urandom(_NONCE))
    conn.send_frame([nonces[1] + proof(authkey, b"client", nonces, host, port)], deadline)
    try:
        reply = conn.recv_frame(_PROOF, deadline)
    except EOFError:
        raise PermissionError(f"fastcall: {host}:{port} refused the key") from None
    if not hmac.compare_digest(bytes(reply), proof(authkey, b"server", nonces, host, port)):
        raise PermissionError(f"fastcall: {host}:{port} could not prove the key: an impostor")
