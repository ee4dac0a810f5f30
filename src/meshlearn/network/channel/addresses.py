"""Which address a service announces to other machines, when it listens on all of them (0.0.0.0)."""

from __future__ import annotations

import socket

WILDCARDS = frozenset({"0.0.0.0", "::", "", "*"})
# Any routable address: a connected UDP socket sends nothing, it only asks the kernel for a route.
SOME_PUBLIC_ADDRESS = ("192.0.2.254", 9)


def is_wildcard(host: str) -> bool:
    """True for a listen address that means every interface (not one a peer can connect to)."""
    return host.strip("[]") in WILDCARDS


def source_address_toward(host: str, port: int = 9) -> str | None:
    """This machine's address on the route to ``host`` (what ``host`` would see us as), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:  # no route, or a name that does not resolve
        return None


def announced_host(listen_host: str, advertise: str, toward: str) -> str:
    """The host part peers should connect to: ``advertise`` if given, else the listen address, or,
    when listening on every interface, this machine's address on the route to ``toward`` (the
    bootstrap), which every peer that can reach the bootstrap over the same network can reach too."""
    if advertise:
        return advertise
    if not is_wildcard(listen_host):
        return listen_host
    return source_address_toward(toward.rpartition(":")[0] or toward) or socket.gethostname()


def reachable_hosts() -> list[str]:
    """Addresses of this machine that another machine may use to reach a service listening on all
    interfaces: the default route's source address, then the host name's addresses, then the name."""
    hosts: list[str] = []
    routed = source_address_toward(*SOME_PUBLIC_ADDRESS)
    if routed:
        hosts.append(routed)
    name = socket.gethostname()
    try:
        hosts += socket.gethostbyname_ex(name)[2]
    except OSError:
        pass
    hosts = [h for h in dict.fromkeys(hosts) if not h.startswith("127.")]
    return hosts + [name]
