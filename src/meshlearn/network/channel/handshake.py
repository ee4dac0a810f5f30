"""The protocol version every connection states at its handshake, and the refusal of another one.

A request's channel is one ZeroMQ connection per call (``channel.rpc``). Both ends put the version
of the network's protocol in the connection's handshake (ZeroMQ's socket metadata, carried in the
encrypted CurveZMQ handshake), and each end reads the other's from the first frame it receives: a
server refuses a request from a client of another version, and a client refuses the reply of a
server of another version, each in one line naming both versions and what to upgrade. Peers of
meshlearn releases before the protocol was versioned state none, and read as version 1.

``PROTOCOL_VERSION`` covers the envelope (``channel.envelope``) and every request declared in
``network.protocol``; a test fails when a declared message changes and the version does not.
"""

from __future__ import annotations

from importlib import metadata

from meshlearn.errors import ProtocolMismatch

PROTOCOL_VERSION = 6  # 1: the releases before the protocol was declared and versioned (they state none);
# 3: task.assign's FedAvg settings hold fedavg_cohort; a claim names its attempt (sent again to another
# bootstrap, it claims once); 4: a task's providers name their ports for punching through NATs;
# 5: task.assign's spec holds the rate UDP engines send at (udp_rate); 6: its training settings hold the
# quasi-global momentum's section (qgdsgdm) and name the optimizers over graphs
UNSTATED = 1  # the version of a peer that states none
PROPERTY = "X-Meshlearn-Protocol"  # the handshake's metadata property (ZeroMQ: names start with X-)
RELEASE_PROPERTY = "X-Meshlearn-Release"  # the meshlearn release the peer runs, for the refusal's line


def release() -> str:
    """This installation's meshlearn release ("unknown" where the package metadata is missing)."""
    try:
        return metadata.version("meshlearn")
    except metadata.PackageNotFoundError:
        return "unknown"


def properties(version: int) -> list[bytes]:
    """What a socket states at each connection's handshake, one ZeroMQ ``METADATA`` option call per
    property: the protocol ``version`` and this release."""
    return [f"{PROPERTY}:{version}".encode(), f"{RELEASE_PROPERTY}:{release()}".encode()]


def stated_version(text: str) -> int | None:
    """The version a peer stated (``UNSTATED`` where it stated none), or None where what it stated
    is not a version."""
    if not text:
        return UNSTATED
    return int(text) if text.isdigit() and len(text) <= 6 else None


def mismatch(ours: int, theirs_text: str, their_release: str, peer: str, own_role: str) -> ProtocolMismatch | None:
    """The refusal of ``peer``, which stated ``theirs_text`` at the handshake (None where it speaks
    ``ours``), in one line: both versions, and on which side to upgrade. ``own_role`` names this end
    ("this client", "this bootstrap")."""
    theirs = stated_version(theirs_text)
    if theirs == ours:
        return None
    them = f"{peer} speaks meshlearn protocol {theirs if theirs is not None else repr(theirs_text[:16])}"
    if their_release:
        them += f" (meshlearn {their_release[:32]})"
    newest, behind = (ours, peer) if theirs is None or theirs < ours else (theirs, own_role)
    return ProtocolMismatch(f"{them}, {own_role} speaks protocol {ours} (meshlearn {release()}): upgrade meshlearn "
                            f"on {behind} (pip install -U meshlearn) so that both speak protocol {newest}")
