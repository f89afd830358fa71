"""The server's port, held from the first moment: bound and listening before anything loads.

`listen` resolves serve.host, refuses to expose a server without a key (a non-loopback address without
serve.api_key is one line, exit 2, unless serve.allow_unauthenticated=true says the network is trusted), then
binds and listens at once. A second server on the same port, even one started at the same instant (both may
bind: SO_REUSEADDR lets a restart reuse a port with closing connections; only one can listen), is refused there
with one line, before any weights load. While the weights load, `Loading` answers every connection with a 503
(`model_loading`, Retry-After), so a load balancer or client waiting for the server sees why at once.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import select
import socket
import threading

from ..config import ConfigError, ServeConfig

LOADING_POLL_S = 0.1  # how often the loading thread looks whether the server took over
LOADING_READ_S = 0.5  # how long it waits for a request's headers before answering anyway
LOADING_BODY = json.dumps(
    {
        "error": {
            "message": "the model is loading: retry in a few seconds",
            "type": "server_error",
            "param": None,
            "code": "model_loading",
        }
    }
).encode()
LOADING_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 5\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(LOADING_BODY)).encode() + b"\r\n\r\n" + LOADING_BODY
)


def exposed(address: str) -> bool:
    """Whether a resolved bind address is reachable from other machines (anything but loopback)."""
    return not ipaddress.ip_address(address.partition("%")[0]).is_loopback


def listen(cfg: ServeConfig) -> socket.socket:
    """A socket bound to serve.host:serve.port and listening (port 0: one the OS picks), or ConfigError saying
    what to change."""
    host, port = cfg.host, cfg.port
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ConfigError(
            f"serve.host={host}: not an address of this machine ({err.strerror}) — use 127.0.0.1 "
            "(this machine only) or 0.0.0.0 (every network)"
        ) from None
    if exposed(address[0]) and cfg.api_key is None and not cfg.allow_unauthenticated:
        raise ConfigError(
            f"serve.host={host} opens the server to the network without a key — set "
            "serve.api_key='${oc.env:GLMTUNE_API_KEY}' (clients then send it as their API key), or "
            "serve.allow_unauthenticated=true on a network you trust, or serve.host=127.0.0.1"
        )
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may bind while old sockets linger
    try:
        sock.bind(address)
        sock.listen(128)  # now: from here on no other server can take the port
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"serve.host={host} is not an address of this machine — use 127.0.0.1 (this machine "
                "only), 0.0.0.0 (every network) or one of its own addresses"
            ) from None
        why = {errno.EADDRINUSE: "is in use by another process", errno.EACCES: "needs privileges (ports < 1024)"}.get(
            err.errno, err.strerror
        )
        raise ConfigError(
            f"serve.port={port} on serve.host={host} {why} — choose another serve.port (0 = any free port)"
        ) from None
    return sock


class Loading:
    """While the block runs (the weights loading), a thread answers each connection on `sock` with a 503."""

    def __init__(self, sock: socket.socket):
        self.sock, self.done = sock, threading.Event()
        self.thread = threading.Thread(target=self._answer, name="glmtune-serve-loading", daemon=True)

    def __enter__(self) -> "Loading":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _answer(self) -> None:
        while not self.done.is_set():
            ready, _, _ = select.select([self.sock], [], [], LOADING_POLL_S)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:  # the client gave up between select and accept
                continue
            with conn:
                conn.settimeout(LOADING_READ_S)
                try:
                    conn.recv(1 << 16)  # the request's head: closing with it unread would reset the connection
                    conn.sendall(LOADING_REPLY)
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
