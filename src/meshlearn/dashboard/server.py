"""A read-only web page that follows a live source (a bootstrap's network, a simulation), served
by Starlette and uvicorn from a background thread. The page updates itself over server-sent
events; everything it loads ships inside the package (no CDN)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from meshlearn.dashboard.access import TokenGate, is_loopback, new_token
from meshlearn.dashboard.connections import (
    PausingListener,
    bounded_http_protocol,
    say_accept_pauses,
)
from meshlearn.errors import UserInputError

log = logging.getLogger(__name__)
Source = Callable[[], dict[str, Any]]
PUSH_EVERY = 0.5  # seconds between looks at the source for each open page
KEEPALIVE = 15.0  # seconds between comments on an idle event stream (proxies close silent ones)
STATIC = {  # the only files served, with their types
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}
FIRST_STATE = '<script src="/static/uPlot.iife.min.js"></script>'  # the page's state goes before its scripts
HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def parse_listen(value: str, what: str = "--dashboard") -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port); the host defaults to loopback. One-line error otherwise."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise UserInputError(f"{what} {value!r} is not [HOST:]PORT (e.g. 8765 or 0.0.0.0:8765)")
    return host, int(port)


class Snapshots:
    """The source's latest state as JSON, computed at most once per ``every`` seconds however
    many pages are open."""

    def __init__(self, source: Source, every: float = PUSH_EVERY / 2):
        self.source = source
        self.every = every
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._text = ""

    def text(self) -> str:
        with self._lock:
            if time.monotonic() - self._at >= self.every:
                try:
                    state = _finite(self.source())
                except Exception as exc:  # the page says what broke; the service goes on
                    log.exception("the dashboard's source failed")
                    state = {"kind": "error", "title": "meshlearn", "message": f"{type(exc).__name__}: {exc}"}
                self._text = json.dumps(state, separators=(",", ":"), allow_nan=False)
                self._at = time.monotonic()
            return self._text


def _finite(value):
    """``value`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise TypeError(f"{type(value).__name__} is not a plain JSON value")


def make_app(source: Source, token: str | None, stopping: threading.Event):
    """The ASGI app: the page, its static files, ``/api/state`` and ``/api/events`` (GET only)."""
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    snapshots = Snapshots(source)
    folder = resources.files("meshlearn.dashboard") / "static"

    def static(name: str) -> Response:
        return Response(folder.joinpath(name).read_bytes(), media_type=STATIC[name], headers=HEADERS)

    async def page(request):
        """The page with the current state in it (a data block, not a script: the CSP holds), so a
        screenshot or a slow client sees the state before the event stream's first update."""
        state = (await asyncio.to_thread(snapshots.text)).replace("<", "\\u003c").replace(">", "\\u003e") \
            .replace("&", "\\u0026")
        html = folder.joinpath("index.html").read_text().replace(
            FIRST_STATE, f'<script id="state" type="application/json">{state}</script>\n{FIRST_STATE}')
        return Response(html, media_type=STATIC["index.html"], headers=HEADERS)

    async def asset(request):
        name = request.path_params["name"]
        if name not in STATIC:
            return Response("not found", status_code=404, media_type="text/plain", headers=HEADERS)
        return static(name)

    async def state(request):
        text = await asyncio.to_thread(snapshots.text)
        return Response(text, media_type="application/json", headers=HEADERS)

    async def events(request):
        async def stream():
            last, quiet_since = None, time.monotonic()
            while not stopping.is_set():
                text = await asyncio.to_thread(snapshots.text)
                if text != last:
                    last, quiet_since = text, time.monotonic()
                    yield f"data: {text}\n\n"
                elif time.monotonic() - quiet_since > KEEPALIVE:
                    quiet_since = time.monotonic()
                    yield ": still here\n\n"
                if await request.is_disconnected():
                    return
                await asyncio.sleep(PUSH_EVERY)
        return StreamingResponse(stream(), media_type="text/event-stream", headers=HEADERS)

    app = Starlette(routes=[
        Route("/", page, methods=["GET"]),
        Route("/static/{name}", asset, methods=["GET"]),
        Route("/api/state", state, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
    ])
    return TokenGate(app, token)


class DashboardServer:
    """Serves ``source`` (a function returning the page's state as plain JSON values) on
    ``host:port``. On a loopback host no token is needed; on any other host, clients from other
    machines need ``token`` (a fresh one when none is given: see ``url``). ``start()`` binds and
    serves from a thread; ``stop()`` ends it."""

    def __init__(self, source: Source, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.source = source
        self.host, self.port = host, port
        self.token = None if is_loopback(host) else (token or new_token())
        self._stopping = threading.Event()
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where to open the page (with the token, where one is needed)."""
        shown = self.host if self.host not in ("0.0.0.0", "::") else socket.gethostname()
        shown = f"[{shown}]" if ":" in shown else shown
        return f"http://{shown}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    def start(self) -> str:
        """Bind (a taken port or bad host is one-line UserInputError) and serve; returns ``url``."""
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = PausingListener(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise UserInputError(f"dashboard: cannot listen on {self.host}:{self.port} ({exc.strerror}): give "
                                 "another port, or a host this machine has") from None
        sock.listen(64)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(make_app(self.source, self.token, self._stopping), log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=2,
                                http=bounded_http_protocol(), loop="asyncio")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(sock),), name="dashboard", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            self.stop()
            raise UserInputError(f"dashboard: the web server did not start on {self.host}:{self.port}")
        self._sock = sock
        return self.url

    async def _serve(self, sock: socket.socket) -> None:
        """uvicorn's server on this thread's asyncio loop, whose listener out of descriptors or
        memory is one line per pause (``PausingListener``, ``say_accept_pauses``)."""
        asyncio.get_running_loop().set_exception_handler(say_accept_pauses("dashboard"))
        await self._server.serve(sockets=[sock])

    def stop(self) -> None:
        """Stop serving (open pages see the stream end) and wait for the thread."""
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    def __enter__(self) -> DashboardServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
