"""A real NAT on this machine, built with Linux network namespaces, for tests of peers behind NAT.

Layout of a ``NatLab(homes=N)`` (namespace short names; the real names carry a unique prefix)::

    pub  (the "internet": public services, ip_forward=0)
     |-- iface "r1" 198.18.1.1/24 <-veth-> "wan" 198.18.1.2/24  r1 (router: masquerade, no port forwarding)
     |                                      "lan" 10.1.0.1/24 <-veth-> "eth0" 10.1.0.2/24  h1 (home)
     |-- iface "r2" 198.18.2.1/24 <-veth-> ...                 r2 ...                     h2
     ...

Every namespace reaches all of pub's addresses; pub cannot reach any 10.x address (no route, and each
router's firewall drops new connections coming in from its wan side); homes cannot reach each other
(pub does not forward), unless ``internet=True``: then pub routes between the routers' public addresses,
so a home reaches another home's router, whose NAT lets in only what answers a flow its home opened (hole
punching), and whose own firewall drops what comes in for the router itself. Each router maps a home's flows as Linux masquerade does (the source port kept where free:
one mapping per local port, whatever the destination), or, for the homes named in ``symmetric``, to a new
random port per flow (a symmetric NAT, which punching cannot cross); the routers of the homes named in
``syn_blocked`` drop every SYN coming in (TCP cannot be punched through them, UDP can). Interface names are per namespace, so
they are short and fixed.

``Sniffer`` captures every packet of one namespace into memory with an AF_PACKET socket.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

CLONE_NEWNET = 0x40000000
ETH_P_ALL = 3
SOL_PACKET = 263
PACKET_STATISTICS = 6
NETNS_DIR = "/run/netns"

_counter = itertools.count()
T = TypeVar("T")


def _run(argv: list[str], input: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run one command; raise RuntimeError naming it and its stderr when it fails."""
    try:
        done = subprocess.run(argv, check=False, input=input, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"natlab: command failed: {' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise RuntimeError(f"natlab: command failed (rc={done.returncode}): {' '.join(argv)}: "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    return done


def _install_tools() -> None:
    """apt-get the tools natlab needs (only called when MESHLEARN_NATLAB_INSTALL=1)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "nftables", "iproute2"]
    try:
        if subprocess.run(install, check=False, capture_output=True, env=env, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update"], check=False, capture_output=True, env=env, timeout=600)
            subprocess.run(install, check=False, capture_output=True, env=env, timeout=600)
    except (OSError, subprocess.SubprocessError):
        return


@functools.cache
def natlab_available() -> str | None:
    """Return None when a NatLab can be built here, else a one-line reason to skip (cached)."""
    if not sys.platform.startswith("linux"):
        return "natlab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "natlab needs root (to create network namespaces)"
    if (shutil.which("ip") is None or shutil.which("nft") is None) \
            and os.environ.get("MESHLEARN_NATLAB_INSTALL") == "1" and shutil.which("apt-get"):
        _install_tools()
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"natlab needs `{tool}` ({package}); set MESHLEARN_NATLAB_INSTALL=1 to apt-get it"
    name = f"mlcheck{os.getpid()}"
    try:
        try:
            _run(["ip", "netns", "add", name], timeout=10)
        except RuntimeError as e:
            return f"cannot create a network namespace: {e}"
        try:
            _run(["ip", "netns", "exec", name, "nft", "-f", "-"],
                 input="table ip natlab_check {\n}\n", timeout=10)
        except RuntimeError as e:
            return f"nftables does not work in a network namespace: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    return None


def _setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def call_in_netns(path: str, work: Callable[[], T]) -> T:
    """``work()``, called in the network namespace at ``path`` (e.g. /run/netns/NAME): what it opens
    (sockets) lives there.

    setns(CLONE_NEWNET) changes only the calling thread's namespace, so a short-lived helper thread
    enters the namespace, calls ``work``, goes back and exits; the sockets it made stay bound to the
    namespace they were created in.  The rest of the process is never moved.
    """
    result: dict = {}

    def run() -> None:
        try:
            here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            try:
                there = os.open(path, os.O_RDONLY)
                try:
                    _setns(there)
                    try:
                        result["value"] = work()
                    finally:
                        with contextlib.suppress(OSError):  # the thread ends right now anyway
                            _setns(here)
                finally:
                    os.close(there)
            finally:
                os.close(here)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="natlab-setns", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def socket_in_netns(path: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM,
                    proto: int = 0) -> socket.socket:
    """Create a socket that lives in the network namespace at ``path`` (e.g. /run/netns/NAME)."""
    return call_in_netns(path, lambda: socket.socket(family, type, proto))


class NatLab:
    """Namespaces ``pub``, ``r1..rN`` and ``h1..hN`` wired as the internet, N NAT routers and N homes.

    Built in the constructor; ``close()`` (or leaving the ``with`` block) kills every process left in
    the lab's namespaces and deletes them.  A setup failure cleans up and raises RuntimeError.
    """

    public_ip = "198.18.1.1"

    def __init__(self, homes: int = 3, internet: bool = False, symmetric: tuple[int, ...] = (),
                 syn_blocked: tuple[int, ...] = ()):
        if not 1 <= homes <= 250:
            raise ValueError("homes must be in 1..250")
        if not set(symmetric) | set(syn_blocked) <= set(range(1, homes + 1)):
            raise ValueError(f"natlab: symmetric or syn_blocked names homes outside 1..{homes}")
        self.homes = homes
        self.internet = internet  # pub forwards between the routers' public addresses (homes reach each other's NAT)
        self.symmetric = frozenset(symmetric)  # homes whose router maps each new flow to a new random port
        self.syn_blocked = frozenset(syn_blocked)  # homes whose router drops every SYN from outside (no TCP punch)
        self._created: list[str] = []
        self._sniffers: list[Sniffer] = []
        self._lock = threading.Lock()
        while True:
            self.prefix = f"ml{os.getpid() % 1000}-{next(_counter)}-"
            if not any(n.startswith(self.prefix) for n in _netns_names()):
                break
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- names and addresses -------------------------------------------------------------------

    def ns(self, name: str) -> str:
        """Full namespace name for a short name: "pub", "r1".."rN", "h1".."hN"."""
        if name != "pub" and not (name[:1] in ("r", "h") and name[1:].isdigit()
                                  and 1 <= int(name[1:]) <= self.homes):
            raise ValueError(f"natlab: no namespace {name!r} (have pub, r1..r{self.homes}, h1..h{self.homes})")
        return self.prefix + name

    def ns_path(self, name: str) -> str:
        """Path of the namespace's bind mount (what setns opens)."""
        return f"{NETNS_DIR}/{self.ns(name)}"

    def home_ip(self, i: int) -> str:
        """Private address of home i (behind router i's NAT)."""
        return f"10.{i}.0.2"

    def router_ip(self, i: int) -> str:
        """Public address of router i: what pub sees as the source of home i's connections."""
        return f"198.18.{i}.2"

    def command(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``ns`` (for subprocess.Popen / run)."""
        return ["ip", "netns", "exec", self.ns(ns), *argv]

    def socket(self, ns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM,
               proto: int = 0) -> socket.socket:
        """A socket of this process that lives in namespace ``ns``."""
        return socket_in_netns(self.ns_path(ns), family, type, proto)

    # -- building and tearing down -------------------------------------------------------------

    def _add_ns(self, name: str) -> None:
        full = self.ns(name)
        _run(["ip", "netns", "add", full])
        self._created.append(full)
        _run(["ip", "-n", full, "link", "set", "lo", "up"])

    def _sysctl(self, name: str, setting: str) -> None:
        _run(["ip", "netns", "exec", self.ns(name), "sysctl", "-qw", setting])

    def _build(self) -> None:
        self._add_ns("pub")
        # new namespaces may inherit 1 from the host; with ``internet`` pub routes between the routers
        self._sysctl("pub", f"net.ipv4.ip_forward={int(self.internet)}")
        for i in range(1, self.homes + 1):
            pub, r, h = self.ns("pub"), self.ns(f"r{i}"), self.ns(f"h{i}")
            self._add_ns(f"r{i}")
            self._add_ns(f"h{i}")
            # A veth whose ifindex equals its peer's gets its carrier up to 1 s late (the kernel's
            # linkwatch treats it as non-urgent), so pub's ends get indexes no fresh router uses.
            _run(["ip", "-n", pub, "link", "add", f"r{i}", "index", str(1000 + i),
                  "type", "veth", "peer", "name", "wan", "netns", r])
            _run(["ip", "-n", r, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", h])
            for ns, dev, addr in ((pub, f"r{i}", f"198.18.{i}.1/24"), (r, "wan", f"198.18.{i}.2/24"),
                                  (r, "lan", f"10.{i}.0.1/24"), (h, "eth0", f"10.{i}.0.2/24")):
                _run(["ip", "-n", ns, "addr", "add", addr, "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", h, "route", "add", "default", "via", f"10.{i}.0.1"])
            _run(["ip", "-n", r, "route", "add", "default", "via", f"198.18.{i}.1"])
            self._sysctl(f"h{i}", "net.ipv4.ip_forward=0")
            self._sysctl(f"r{i}", "net.ipv4.ip_forward=1")
            mapping = " random" if i in self.symmetric else ""  # random: a new port per flow (symmetric NAT)
            # a firewall that lets no connection be opened from outside, not even one its home is opening
            # to the same address at once (a TCP simultaneous open): UDP still gets through
            syn_rule = "  iifname \"wan\" tcp flags & (syn | ack) == syn drop\n" if i in self.syn_blocked else ""
            # with the internet on, a home router's own firewall: nothing unasked-for from the wan side
            # reaches the router itself (so it neither answers it nor keeps a conntrack entry that would
            # take a mapping a home's flow needs). Without it, a router can serve as a public machine.
            input_rules = ("  iifname \"wan\" ct state established,related accept\n"
                           "  iifname \"wan\" drop\n") if self.internet else ""
            _run(["ip", "netns", "exec", r, "nft", "-f", "-"], input=(
                "table ip natlab {\n"
                " chain postrouting {\n"
                "  type nat hook postrouting priority srcnat; policy accept;\n"
                f"  oifname \"wan\" ip saddr 10.{i}.0.0/24 masquerade{mapping}\n"
                " }\n"
                " chain input {\n"
                "  type filter hook input priority filter; policy accept;\n"
                f"{input_rules}"
                " }\n"
                " chain forward {\n"
                "  type filter hook forward priority filter; policy accept;\n"
                f"{syn_rule}"
                "  iifname \"wan\" ct state established,related accept\n"
                "  iifname \"wan\" drop\n"
                " }\n"
                "}\n"))
        self._wait_links_up()

    def _wait_links_up(self, timeout: float = 5.0) -> None:
        """Wait until every veth reports carrier (operstate UP), so the first packets are not lost."""
        names = ["pub"] + [f"{k}{i}" for i in range(1, self.homes + 1) for k in ("r", "h")]
        deadline = time.monotonic() + timeout
        for name in names:
            while True:
                out = _run(["ip", "-n", self.ns(name), "-br", "link"]).stdout
                down = [line for line in out.splitlines()
                        if line.split()[:1] != ["lo"] and line.split()[1:2] != ["UP"]]
                if not down:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"natlab: links still down in {self.ns(name)}: {down}")
                time.sleep(0.01)

    def close(self) -> None:
        """Stop sniffers, SIGKILL every process in the lab's namespaces, delete them. Idempotent, never raises."""
        with contextlib.suppress(Exception), self._lock:
            for sniffer in list(self._sniffers):
                with contextlib.suppress(Exception):
                    sniffer.stop()
            created, self._created = list(self._created), []
            for full in created:
                with contextlib.suppress(Exception):
                    pids = subprocess.run(["ip", "netns", "pids", full], check=False, capture_output=True,
                                          text=True, timeout=10).stdout.split()
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                            os.kill(int(pid), signal.SIGKILL)
            for full in reversed(created):
                with contextlib.suppress(Exception):
                    subprocess.run(["ip", "netns", "del", full], check=False, capture_output=True, timeout=10)
            atexit.unregister(self.close)

    def __enter__(self) -> NatLab:  # noqa: PYI034 - typing.Self needs Python 3.11, the project supports 3.10
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _netns_names() -> list[str]:
    try:
        return os.listdir(NETNS_DIR)
    except OSError:
        return []


class Sniffer:
    """Captures every packet (both directions, every interface) of one lab namespace into memory.

    ``Sniffer(lab, "pub")``; ``start()``/``stop()`` or a ``with`` block; ``data()`` is all captured
    bytes concatenated (link-layer frames included), ``packets`` how many were kept, ``dropped``
    how many were not kept because the capture reached ``cap_bytes``, ``kernel_drops`` (after
    ``stop()``) how many the kernel dropped because the socket buffer was full.  A searched byte
    string is found only if it lies within one captured packet.
    """

    def __init__(self, lab: NatLab, ns: str, cap_bytes: int = 400 * 2**20):
        self.lab, self.ns, self.cap_bytes = lab, ns, cap_bytes
        self.packets = 0
        self.dropped = 0
        self.kernel_drops = 0
        self._size = 0
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Sniffer:
        """Open the capture socket in the namespace (capturing from now on) and start reading it."""
        if self._thread is not None:
            return self
        sock = self.lab.socket(self.ns, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 64 * 2**20)
        sock.settimeout(0.1)
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"natlab-sniff-{self.ns}", daemon=True)
        self._thread.start()
        self.lab._sniffers.append(self)
        return self

    def _loop(self) -> None:
        buf = bytearray(1 << 20)  # GSO super-packets on veth can exceed one MTU
        view = memoryview(buf)
        while True:
            try:  # once stopping, read what is still queued without waiting, then end
                n = self._sock.recv_into(buf, 0, socket.MSG_DONTWAIT if self._stop.is_set() else 0)
            except (TimeoutError, BlockingIOError):
                if self._stop.is_set():
                    break
                continue
            except OSError:
                break
            with self._lock:
                if self._size + n > self.cap_bytes:
                    self.dropped += 1
                    continue
                self._chunks.append(bytes(view[:n]))
                self._size += n
                self.packets += 1

    def stop(self) -> None:
        """Stop capturing (what was captured stays readable). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            with contextlib.suppress(OSError):  # struct tpacket_stats {unsigned tp_packets, tp_drops}
                stats = self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
                self.kernel_drops += int.from_bytes(stats[4:8], sys.byteorder)
            self._sock.close()
            self._sock = None
        if self in self.lab._sniffers:
            self.lab._sniffers.remove(self)

    def data(self) -> bytes:
        """All captured packet bytes, concatenated in arrival order."""
        with self._lock:
            return b"".join(self._chunks)

    def __enter__(self) -> Sniffer:  # noqa: PYI034 - typing.Self needs Python 3.11, the project supports 3.10
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


WINDOW = 48  # bytes of a known tensor searched for in a capture


def varied_windows(data: bytes, count: int = 4) -> list[bytes]:
    """A few stretches of ``data`` varied enough (six different 4-byte words or more) that finding
    one in a capture by chance is out of the question, unlike a run of zero pixels."""
    found = []
    for start in range(0, len(data) - WINDOW, WINDOW):
        piece = data[start:start + WINDOW]
        if len({piece[i:i + 4] for i in range(0, WINDOW, 4)}) >= 6:
            found.append(piece)
        if len(found) == count:
            break
    return found
