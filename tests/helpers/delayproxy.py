"""A TCP proxy that delays every chunk it forwards, both ways: a far-away provider on loopback."""

from __future__ import annotations

import socket
import threading
import time


class DelayProxy:
    """Listens on ``listen`` (host, port) and forwards each connection to ``target``, holding every
    chunk ``delay`` seconds before passing it on. ``start()`` serves from threads; ``stop()`` closes."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: float):
        self.listen, self.target, self.delay = listen, target, delay
        self._server: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._stopped = threading.Event()

    def start(self) -> "DelayProxy":
        self._server = socket.create_server(self.listen)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:  # nothing listens behind the proxy (yet)
                client.close()
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                time.sleep(self.delay)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stopped.set()
        for sock in [self._server, *self._sockets]:
            if sock is not None:
                sock.close()
