"""Who may read a dashboard: a client on this machine (loopback) that names it by its own address,
others only with its token."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import ipaddress
import secrets
import socket
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

COOKIE = "meshlearn_dashboard"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, or a name) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def names_this_machine(host_header: str) -> bool:
    """Whether an HTTP ``Host`` value names this machine: an IP address (a literal address cannot
    be rebound), ``localhost``, or this machine's own host name. A browser on this machine sends a
    page's own name, so a page on a name an attacker's DNS points at 127.0.0.1 (DNS rebinding) is
    refused, not read."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host.rstrip(".") in _own_names() or host.endswith(".localhost")


@functools.cache
def _own_names() -> frozenset[str]:
    """This machine's names (looked up once: a resolver may be slow)."""
    return frozenset({"localhost", socket.gethostname().lower(), socket.getfqdn().lower()})


def new_token() -> str:
    """A fresh random token for a dashboard reachable from other machines."""
    return secrets.token_urlsafe(24)


def token_from_secret(secret: bytes) -> str:
    """A dashboard token derived from a network's secret (HMAC-SHA256): stable across restarts,
    known to whoever holds the secret, and not the secret itself."""
    digest = hmac.new(secret, b"meshlearn dashboard token v1", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")[:32]


class TokenGate:
    """ASGI middleware: loopback clients pass if their ``Host`` names this machine (no DNS
    rebinding); any other client must show ``token``, as
    ``?token=`` (answered with a cookie and a redirect that drops it from the address bar), as
    that cookie, or as ``Authorization: Bearer``. Without a token, only loopback clients pass."""

    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client") or ("", 0)
        if is_loopback(client[0]):
            if names_this_machine(_header(scope, "host")):
                return await self.app(scope, receive, send)
            return await _respond(send, 403, b"this dashboard answers on this machine only under its own address (open "
                                  b"http://127.0.0.1:PORT/): a page under another name may be a DNS-rebinding attack",
                                  [(b"content-type", b"text/plain")])
        shown = self._shown(scope)
        if self.token and shown is not None and hmac.compare_digest(shown[0].encode(), self.token.encode()):
            if shown[1] == "query":  # keep it in a cookie, not in the address bar or the history
                return await _respond(send, 303, b"", [(b"location", scope["path"].encode() or b"/"),
                                                        (b"set-cookie", _cookie(self.token))])
            return await self.app(scope, receive, send)
        text = (b"this dashboard needs its token: open the address with ?token=... that its service printed"
                if self.token else b"this dashboard answers only on this machine (loopback)")
        return await _respond(send, 401 if self.token else 403, text, [(b"content-type", b"text/plain")])

    @staticmethod
    def _shown(scope) -> tuple[str, str] | None:
        """(the token the client showed, where: query, cookie or header), or None."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if query.get("token"):
            return query["token"][0], "query"
        headers = _headers(scope)
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip(), "header"
        if "cookie" in headers:
            cookie = SimpleCookie()
            try:
                cookie.load(headers["cookie"])
            except Exception:  # noqa: BLE001 - a malformed cookie header is no token
                return None
            if COOKIE in cookie:
                return cookie[COOKIE].value, "cookie"
        return None


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _header(scope, name: str) -> str:
    return _headers(scope).get(name, "")


def _cookie(token: str) -> bytes:
    return f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode()


async def _respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
