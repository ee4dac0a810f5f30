"""A transport peer in its own process, driven by the transport tests.

Usage: python peer.py NODE_ID PEER_ID PEER_ADDRESS MODE
Prints its own address on the first line of stdout, then connects to the peer.
"""

import sys

import torch

from meshlearn.transport import TcpTransport
from meshlearn.transport.settings import TcpSettings
from meshlearn.wire import Kind, Message


def main() -> None:
    node_id, peer_id, peer_address, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    transport = TcpTransport(node_id, settings=TcpSettings(handshake_timeout=20, wait_timeout=20))
    print(transport.bind(), flush=True)
    try:
        transport.connect({peer_id: peer_address})
        if mode == "out-of-order":
            for iteration in (2, 0, 1):
                transport.send(peer_id, Message(Kind.MODEL, node_id, iteration, 1, {"p": torch.full((1000,), float(iteration))}))
        elif mode == "echo":
            while True:
                msg = transport.recv(20)
                if msg is None or msg.kind == Kind.BYE:
                    break
                if msg.kind == Kind.MODEL:
                    transport.send(peer_id, Message(Kind.MODEL, node_id, msg.iteration, 1, {"p": msg.tensors["p"] * 2}))
        elif mode == "hang":
            sys.stdin.read()  # handshake done; now never send anything until killed
    finally:
        transport.close()


if __name__ == "__main__":
    main()
