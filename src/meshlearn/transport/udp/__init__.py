"""Lossy UDP transport: models cut into checksummed datagrams, reassembled chunk by chunk.

Three parts, each with one job:

- ``reassembly``: the ``Reassembler``, a pure core (no socket, thread or clock) that turns
  received chunks into per-(sender, iteration) models and hands them out per gather;
- ``sender``: the ``DatagramSender``, which cuts messages into datagrams, paces them and applies
  the emulated loss and delay (clock injectable);
- ``handshake``: the HELLO handshake as state (who was heard, who heard this node);
- ``sockets``: the socket's set-up (a receive buffer large enough not to drop while training);
- ``transport``: ``UdpTransport``, two thin threads (receive, and release of delayed datagrams)
  and ``gather`` around those cores.

``gather`` differs by mode:

- ``sync``: wait until every neighbour's model for this iteration is complete, or the timeout;
  returns the moment the last chunk is in (or came damaged: a chunk that fails its checksum or
  seal is not sent again, so it is missing at once, not waited for). Chunks that miss their
  deadline are not thrown away (unless ``late_chunks: drop``, the study's behaviour): they stand
  in for the same sender's chunks missing at the next iteration. Once the timeout cuts every
  iteration (any loss at all), nodes that started a little apart stay apart, and a neighbour's
  chunks can land just after each deadline, iteration after iteration; one iteration late, they
  are still news.
- ``async``: no waiting; take, per neighbour, the newest model received so far (the study's
  "UDP_threading", kept to reproduce it).

Messages with tensors must hold the tensors of the layout given to the transport
(``meshlearn.layout.TensorLayout``: a FlatState's segments, or a sharing scheme's message); each
arrives with ``msg.chunks`` saying which chunks made it.
"""

from meshlearn.transport.settings import ETHERNET_CHUNK, LOOPBACK_CHUNK, UdpSettings, default_chunk_bytes
from meshlearn.transport.udp.reassembly import Partial, Reassembler
from meshlearn.transport.udp.sender import DatagramSender
from meshlearn.transport.udp.sockets import SO_RCVBUFFORCE, rcvbuf_errors
from meshlearn.transport.udp.transport import UdpTransport

__all__ = [
    "DatagramSender", "ETHERNET_CHUNK", "LOOPBACK_CHUNK", "Partial", "Reassembler", "SO_RCVBUFFORCE",
    "UdpSettings", "UdpTransport", "default_chunk_bytes", "rcvbuf_errors",
]
