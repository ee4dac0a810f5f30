"""An outsider without the secret, in its own process (so its buffers are not counted as the
victim's), driven by tests/test_attacks.py. Prints "done" when its attack is sent.

    python attacker.py tcp ADDRESS FLOAT32S FLOOD   claim node 1's identity, HELLO as 1, crashing shape, flood
    python attacker.py squat ADDRESS...             every node's identity at every node, crashing requests
    python attacker.py udp HOST:PORT TOTAL CHUNK FLOOD   spoofed datagrams of node 1 for new far iterations
"""

import socket
import struct
import sys
import time

import torch
import zmq
from frames import empty_tensor_with_a_huge_dimension

from meshlearn.wire import Kind, Message, encode
from meshlearn.wire.datagram import ChunkHeader, chunk_count, pack_header


def tcp(address: str, floats: int, flood: int) -> None:
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.ROUTING_ID, struct.pack("<I", 1))  # node 1's identity before routing ids were random
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.SNDHWM, 10)
    rogue.connect(address)
    rogue.send_multipart(encode(Message(Kind.HELLO, 1)))
    rogue.send_multipart(empty_tensor_with_a_huge_dimension(sender=1, iteration=1))
    state = {"p": torch.zeros(floats)}
    sent, last_progress = 0, time.monotonic()
    while sent < flood and time.monotonic() - last_progress < 2.0:
        try:
            rogue.send_multipart(encode(Message(Kind.MODEL, 1, 100_000 + sent, 2, state)), zmq.NOBLOCK)
            sent, last_progress = sent + 1, time.monotonic()
        except zmq.Again:  # the victim reads no more of this connection for now
            time.sleep(0.01)
    print(f"done {sent}", flush=True)
    sys.stdin.read()  # keep the connection (and its claim) until the test ends


def squat(addresses: list[str]) -> None:
    ctx = zmq.Context()
    sockets = []
    for address in addresses:
        for claimed in range(len(addresses)):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, struct.pack("<I", claimed))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sockets.append(sock)
    for sock in sockets:
        sock.send_multipart(empty_tensor_with_a_huge_dimension(kind=Kind.REQUEST, sender=1))
    time.sleep(0.5)  # connected and sent before the nodes connect
    print("done", flush=True)
    sys.stdin.read()


def udp(where: str, total: int, chunk: int, flood: int) -> None:
    host, port = where.rsplit(":", 1)
    count = chunk_count(total, chunk)
    payload = bytes(min(chunk, total))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as spoofer:
        for k in range(flood):  # a new iteration per datagram: each used to cost a whole model
            header = ChunkHeader(Kind.MODEL, 1, 100_000 + k, 0, count, chunk, 2, total)
            spoofer.sendto(pack_header(header, [memoryview(payload)]) + payload, (host, int(port)))
            if k % 100 == 0:
                time.sleep(0.005)  # about memory, not about overflowing the receive buffer
        for k in range(flood):  # control messages nobody reads
            spoofer.sendto(pack_header(ChunkHeader(Kind.REQUEST, 1, k, 0, 1, chunk, 0, 0)), (host, int(port)))
    print("done", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "tcp":
        tcp(args[0], int(args[1]), int(args[2]))
    elif mode == "squat":
        squat(args)
    else:
        udp(args[0], int(args[1]), int(args[2]), int(args[3]))
