"""What a request must be before any route reads it: sent to this server by name, not from a foreign web page,
and JSON. An ASGI middleware around the whole app; each refusal is one OpenAI-shaped error.

A page on any site can make the browser of someone running a local server send it requests. Three doors:
  * a "simple" cross-site POST (`Content-Type: text/plain`, no CORS preflight) reaches the route and runs a
    generation; its `Origin` header says where it came from: an `Origin` other than the server's own is a 403
    unless serve.allow_origins lists it (those get CORS headers and their preflights answered, nothing else);
  * DNS rebinding: evil.example first resolves to the attacker, then to 127.0.0.1, so the page becomes
    "same-origin" with the server and can read its replies; its requests still say `Host: evil.example`, so the
    `Host` must name the bound address, a loopback name, or one of serve.allow_hosts (421 otherwise; a wildcard
    bind also takes any IP literal and this machine's host name: a rebinding attack needs a domain name);
  * a form or `text/plain` body: a POST must be `Content-Type: application/json` (415), which a browser only
    sends cross-site after a preflight that this server answers for serve.allow_origins alone.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from .protocol import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
PREFLIGHT_MAX_AGE_S = "600"  # browsers cache an allowed preflight this long


def ip_literal(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_name(header: str) -> str:
    """`Host` without its port, lower case, without a trailing dot: `[::1]:8000` -> `::1`."""
    value = header.strip().lower()
    if value.startswith("["):
        value = value[1 : value.find("]")] if "]" in value else value
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


@dataclass(frozen=True)
class Hosts:
    """The `Host` names this server answers to."""

    names: frozenset[str]
    any_ip: bool  # a wildcard bind: whatever address of this machine the client used

    @classmethod
    def for_bind(cls, host: str, extra: list[str]) -> "Hosts":
        names = set(LOOPBACK_NAMES) | {host_name(h) for h in extra} | {host_name(host)}
        wildcard = host in WILDCARD_HOSTS
        if wildcard:
            names.add(socket.gethostname().lower())
        return cls(frozenset(names), wildcard)

    def allows(self, header: str | None) -> bool:
        if not header:
            return False
        name = host_name(header)
        return name in self.names or (self.any_ip and ip_literal(name) is not None)


def refusal(status: int, message: str, code: str) -> Response:
    return JSONResponse(ApiError(status, message, None, code).body(), status_code=status)


class Guard:
    """The ASGI app `app` behind the Host, Origin and Content-Type checks (module docstring)."""

    def __init__(self, app, hosts: Hosts, allow_origins: list[str]):
        self.app, self.hosts = app, hosts
        self.origins = frozenset(o.rstrip("/").lower() for o in allow_origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        response, origin = self.check(scope)
        if response is not None:
            return await response(scope, receive, send)
        if origin is None:
            return await self.app(scope, receive, send)

        async def with_cors(message):  # a listed origin may read the reply
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    *((k.encode("latin-1"), v.encode("latin-1")) for k, v in self.cors(origin).items()),
                ]
            await send(message)

        await self.app(scope, receive, with_cors)

    def check(self, scope) -> tuple[Response | None, str | None]:
        """(the refusal, None) or (None, the allowed foreign origin to answer with CORS headers, if any)."""
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.hosts.allows(host):
            return refusal(
                421,
                f"this server does not answer to the host {host!r}: use its address (or localhost), "
                "or add the name to serve.allow_hosts",
                "misdirected_request",
            ), None
        origin = headers.get("origin")
        foreign = origin is not None and origin.rstrip("/").lower() != f"{scope.get('scheme', 'http')}://{host}".lower()
        if foreign and origin.rstrip("/").lower() not in self.origins:
            return refusal(
                403,
                f"requests from the web page origin {origin!r} are refused: start the server with "
                f"serve.allow_origins=[{origin}] to let that page call it",
                "origin_not_allowed",
            ), None
        if scope["method"] == "OPTIONS":  # a CORS preflight: only a listed origin gets here
            if not foreign:
                return refusal(
                    405, "OPTIONS is only answered to the origins in serve.allow_origins", "method_not_allowed"
                ), None
            return Response(status_code=204, headers=self.cors(origin, preflight=True)), None
        media = headers.get("content-type", "").partition(";")[0].strip().lower()
        if scope["method"] == "POST" and media != "application/json":
            return refusal(
                415,
                f"the body must be sent as Content-Type: application/json (got {media or 'none'!r})",
                "unsupported_media_type",
            ), None
        return None, origin if foreign else None

    @staticmethod
    def cors(origin: str, preflight: bool = False) -> dict[str, str]:
        headers = {"access-control-allow-origin": origin, "vary": "Origin"}
        if preflight:
            headers.update(
                {
                    "access-control-allow-methods": "GET, POST",
                    "access-control-allow-headers": "authorization, content-type",
                    "access-control-max-age": PREFLIGHT_MAX_AGE_S,
                }
            )
        return headers
