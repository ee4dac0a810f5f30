"""A stranger holding connections open, in its own process (its descriptors are not the victim's),
driven by tests/test_attack_network.py. Prints "holding N" once every connection is open, then keeps
them held: each one a server closes is opened again (at most RECONNECTS_PER_SECOND), until stdin
closes.

    python flooder.py KIND:HOST:PORT:COUNT ...

KIND is ``silent`` (connect, send nothing), ``greeting`` (send the first bytes of a ZeroMQ
greeting, then nothing: what a client stuck in its handshake looks like) or ``http`` (connect to a
web page, send nothing).
"""

import resource
import selectors
import socket
import sys
import threading
import time

RECONNECTS_PER_SECOND = 200
ZMTP_GREETING_START = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03"  # signature and major version


def _open(kind: str, host: str, port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except OSError:
        return None
    if kind == "greeting":
        try:
            sock.sendall(ZMTP_GREETING_START)
        except OSError:
            sock.close()
            return None
    sock.setblocking(False)
    return sock


def main(targets: list[str]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    selector = selectors.DefaultSelector()
    wanted: list[tuple[str, str, int]] = []
    for target in targets:
        kind, host, port, count = target.split(":")
        wanted += [(kind, host, int(port))] * int(count)
    for spec in wanted:
        sock = _open(*spec)
        if sock is not None:
            selector.register(sock, selectors.EVENT_READ, spec)
    print(f"holding {len(selector.get_map())}", flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    closed: list[tuple[str, str, int]] = []
    while not done.is_set():
        for key, _ in selector.select(timeout=0.1):
            try:
                data = key.fileobj.recv(65536)
            except OSError:
                data = b""
            if not data:  # the server closed it: open another in its place
                selector.unregister(key.fileobj)
                key.fileobj.close()
                closed.append(key.data)
        budget = RECONNECTS_PER_SECOND // 10
        while closed and budget:
            spec = closed.pop(0)
            sock = _open(*spec)
            if sock is None:
                closed.append(spec)
                break
            selector.register(sock, selectors.EVENT_READ, spec)
            budget -= 1
        time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv[1:])
