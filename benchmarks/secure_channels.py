"""Groundwork for issue 17: what encrypting a model exchange costs with each standard mechanism.

One 44.7 MB message (ResNet-18's parameters) from one process to another on loopback, best of
``--reps``, side by side in one run: ZeroMQ in the clear (today's transport, unsigned), CurveZMQ
(the pyzmq wheel's libzmq), TLS 1.3 over a plain socket (Python's ssl, OpenSSL), and, for scale,
the AEAD ciphers of `cryptography` (encrypt then decrypt in one process, one core).

    python benchmarks/secure_channels.py [--mb 44.7] [--reps 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import ssl
import subprocess
import tempfile
import time

import zmq


def _zmq_receiver(port_pipe, curve_keys, reps: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if curve_keys:
        sock.curve_publickey, sock.curve_secretkey = curve_keys
        sock.curve_server = True
    port_pipe.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    for _ in range(reps + 1):  # the first is the connection's warm-up
        sock.recv_multipart(copy=False)
        port_pipe.send(time.perf_counter())
    ctx.destroy(0)


def zmq_seconds(payload: bytes, reps: int, curve: bool) -> float:
    """Best one-way time of ``payload`` from a DEALER to a ROUTER in another process."""
    server_keys = zmq.curve_keypair() if curve else None
    mine, theirs = mp.Pipe()
    proc = mp.Process(target=_zmq_receiver, args=(theirs, server_keys, reps))
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if curve:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_keys[0]
    sock.connect(f"tcp://127.0.0.1:{mine.recv()}")
    sock.send(b"warm-up")
    mine.recv()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        sock.send(payload, copy=False)
        best = min(best, mine.recv() - start)
    proc.join()
    ctx.destroy(0)
    return best


def _tls_contexts(folder: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", f"{folder}/key.pem", "-out", f"{folder}/cert.pem", "-days", "1",
                    "-subj", "/CN=meshlearn-bench"], check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(f"{folder}/cert.pem", f"{folder}/key.pem")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.load_verify_locations(f"{folder}/cert.pem")
    return server, client


def _socket_receiver(listener: socket.socket, context, size: int, reps: int, pipe) -> None:
    conn, _ = listener.accept()
    if context is not None:
        conn = context.wrap_socket(conn, server_side=True)
    buffer = memoryview(bytearray(size))
    for _ in range(reps):
        got = 0
        while got < size:
            got += conn.recv_into(buffer[got:], min(size - got, 1 << 20))
        pipe.send(time.perf_counter())
    conn.close()


def socket_seconds(payload: bytes, reps: int, tls: bool) -> float:
    """Best one-way time of ``payload`` over one TCP connection (TLS or clear) to another process."""
    with tempfile.TemporaryDirectory() as folder:
        server, client = _tls_contexts(folder) if tls else (None, None)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        mine, theirs = mp.Pipe()
        proc = mp.Process(target=_socket_receiver, args=(listener, server, len(payload), reps, theirs))
        proc.start()
        sock = socket.create_connection(listener.getsockname())
        if client is not None:
            sock = client.wrap_socket(sock)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            sock.sendall(payload)
            best = min(best, mine.recv() - start)
        proc.join()
        sock.close()
        listener.close()
    return best


def aead_seconds(payload: bytes, reps: int) -> dict[str, float]:
    """Best encrypt + decrypt time of ``payload`` per AEAD of `cryptography` (empty if absent)."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    except ImportError:
        return {}
    times = {}
    for name, cipher in (("AES-256-GCM", AESGCM(os.urandom(32))), ("ChaCha20-Poly1305", ChaCha20Poly1305(os.urandom(32)))):
        best = float("inf")
        for _ in range(reps):
            nonce = os.urandom(12)
            start = time.perf_counter()
            cipher.decrypt(nonce, cipher.encrypt(nonce, payload, None), None)
            best = min(best, time.perf_counter() - start)
        times[name] = best
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=44.7, help="message size in MB (default: 44.7, ResNet-18)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions; the best is kept (default: 5)")
    args = parser.parse_args()
    mp.set_start_method("fork")
    payload = os.urandom(int(args.mb * 1e6))
    rows = {
        "ZeroMQ, clear": zmq_seconds(payload, args.reps, curve=False),
        "CurveZMQ": zmq_seconds(payload, args.reps, curve=True),
        "TCP socket, clear": socket_seconds(payload, args.reps, tls=False),
        "TLS 1.3 (Python ssl)": socket_seconds(payload, args.reps, tls=True),
    }
    rows.update({f"{name} encrypt+decrypt, one core": t for name, t in aead_seconds(payload, args.reps).items()})
    base = rows["ZeroMQ, clear"]
    print(f"{args.mb:g} MB one way, best of {args.reps}; libzmq {zmq.zmq_version()}, {ssl.OPENSSL_VERSION}")
    print("| mechanism | time | throughput | vs ZeroMQ clear |\n|---|---|---|---|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds * 1000:.1f} ms | {len(payload) / seconds / 1e9:.2f} GB/s | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
