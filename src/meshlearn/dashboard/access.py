"""Who may read a dashboard: any client on this machine (loopback), others only with its token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
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


def new_token() -> str:
    """A fresh random token for a dashboard reachable from other machines."""
    return secrets.token_urlsafe(24)


def token_from_secret(secret: bytes) -> str:
    """A dashboard token derived from a network's secret (HMAC-SHA256): stable across restarts,
    known to whoever holds the secret, and not the secret itself."""
    digest = hmac.new(secret, b"meshlearn dashboard token v1", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")[:32]


class TokenGate:
    """ASGI middleware: loopback clients pass; any other client must show ``token``, as
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
            return await self.app(scope, receive, send)
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
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
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


def _cookie(token: str) -> bytes:
    return f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode()


async def _respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
