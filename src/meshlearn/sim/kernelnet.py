"""Real packet loss made by the kernel: a simulation inside a private network namespace whose
loopback drops a share of all packets (an nftables ``numgen random`` rule).

TCP then really retransmits (timeouts, backoff, congestion control), which user space cannot
imitate. The rule sits on lo's ingress hook, which every packet crosses once, so data segments and
ACKs, both directions, are dropped alike. The kernel draws each drop independently:
correlated (bursty) loss is not possible there. Delay and jitter stay in the transports (user
space) either way. lo gets an Ethernet MTU (1,500 bytes) in that namespace, and UDP's default
chunk follows it, so a model crosses it in as many packets as on a LAN. Needs root and ``nft``; ``loss_mode: auto`` falls back to user space with a
warning where either is missing.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from meshlearn.config import ExperimentConfig
from meshlearn.errors import ConfigError, MeshlearnError
from meshlearn.exiting import exit_now

log = logging.getLogger(__name__)
CLONE_NEWNET = 0x40000000
INSIDE = "MESHLEARN_LOSS_NETNS"  # set in the namespaced child so it does not enter another one
TABLE = "meshlearn_loss"
ETHERNET_MTU = 1500
Engine = Callable[..., Any]  # engine(config, progress=...) -> a result with its ``output`` folder
SIOCETHTOOL, ETHTOOL_STSO, ETHTOOL_SGSO = 0x8946, 0x1F, 0x24


def kernel_loss_unavailable() -> str | None:
    """Why kernel packet loss cannot be made on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "it needs root (a network namespace and an nftables rule)"
    if shutil.which("nft") is None:
        return "nftables is not installed (apt-get install nftables)"
    return None


def resolve_loss_mode(config: ExperimentConfig) -> ExperimentConfig:
    """Settle ``loss_mode: auto`` for a local simulation and check an explicit ``kernel``.

    auto: TCP loss in the kernel where possible (user space can only model it); UDP loss in user
    space, which draws correlated loss exactly, per datagram. Without loss nothing changes.
    """
    spec = config.net
    if not spec.loss:
        return config.model_copy(update={"loss_mode": "user"}) if config.loss_mode == "auto" else config
    reason = kernel_loss_unavailable()
    mode = config.loss_mode
    if mode == "kernel" and reason and not os.environ.get(INSIDE):
        raise ConfigError(f"loss_mode kernel: {reason}; or use loss_mode user")
    if mode == "auto":
        if config.transport == "udp":
            mode = "user"
        elif reason:
            log.warning("TCP loss from the kernel is unavailable (%s): modelling it in user space as "
                        "retransmission delay instead (see docs/network-emulation.md)", reason)
            mode = "user"
        else:
            mode = "kernel"
    if mode == "kernel" and spec.corr:
        log.warning("the kernel drops packets independently: corr=%g%% is not applied (use loss_mode user "
                    "for correlated loss over UDP)", spec.corr * 100)
    return config.model_copy(update={"loss_mode": mode})


def needs_namespace(config: ExperimentConfig) -> bool:
    """Whether this (resolved) run must move into a lossy namespace first."""
    return config.loss_mode == "kernel" and bool(config.net.loss) and not os.environ.get(INSIDE)


def _unshare_network() -> None:
    """In the child, between fork and exec: a fresh network namespace (only a down lo in it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


def run_in_namespace(config: ExperimentConfig, progress: bool, engine: Engine) -> Path:
    """Run ``config`` with ``engine`` (a module-level function, called with the config and
    ``progress=``) in a child process inside a lossy namespace; returns its output folder.

    The child is a fresh interpreter, so it is given the engine's import path, not the function:
    this module then needs no engine module (sim.run, which imports this one, names the engine)."""
    env = {**os.environ, INSIDE: "1"}
    error_read, error_write = os.pipe()  # the child's one-line error, if it fails
    command = [sys.executable, "-m", "meshlearn.sim.kernelnet", f"{engine.__module__}:{engine.__qualname__}",
               config.model_dump_json(), "1" if progress else "0", str(error_write)]
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=_unshare_network, pass_fds=(error_write,))
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"loss_mode kernel: could not create a network namespace ({exc}); "
                          "use loss_mode user") from None
    finally:
        os.close(error_write)
    with os.fdopen(error_read, "rb") as errors:
        try:
            message = errors.read().decode(errors="replace").strip()
            code = child.wait()
        except KeyboardInterrupt:  # the child got the same Ctrl-C and stops its nodes; wait for that
            child.wait(timeout=30)
            raise
    if code != 0:
        error = MeshlearnError(message or f"the simulation in the lossy network namespace failed (exit code {code})")
        error.exit_code = code if code in (1, 2) else 1
        raise error
    return Path(config.output)


def _loopback_up() -> None:
    """Bring lo up with an Ethernet MTU, so TCP segments and UDP fragments are as on a LAN (on
    lo's own 64 KiB MTU a whole small model is a couple of packets, and loss would barely bite)."""
    siocgifflags, siocsifflags, siocsifmtu, iff_up = 0x8913, 0x8914, 0x8922, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock, siocsifmtu, struct.pack("16si", b"lo", ETHERNET_MTU))
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, siocgifflags, request)[:18])[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH", b"lo", flags | iff_up))
        # Segmentation offloads off, so packets reach lo's ingress hook (where the drop rule sits)
        # cut to the MTU, as on a wire. (TCP hands the output hook 64 KB super-packets regardless.)
        for command in (ETHTOOL_STSO, ETHTOOL_SGSO):
            value = ctypes.create_string_buffer(struct.pack("II", command, 0))
            try:
                fcntl.ioctl(sock, SIOCETHTOOL, struct.pack("16sP", b"lo", ctypes.addressof(value)))
            except OSError as exc:
                log.warning("could not turn off offload %#x on lo (%s): drops hit coarser packets", command, exc)


def install_drop_rule(loss: float) -> None:
    """Drop ``loss`` (0..1) of all packets leaving lo in the current namespace."""
    basis_points = round(loss * 10_000)
    rules = (f'table netdev {TABLE} {{\n  chain ingress {{\n    type filter hook ingress device "lo" priority 0; '
             f'policy accept;\n    counter\n    numgen random mod 10000 < {basis_points} counter drop\n  }}\n}}\n')
    result = subprocess.run(["nft", "-f", "-"], input=rules, text=True, capture_output=True)
    if result.returncode != 0:
        raise ConfigError(f"nftables refused the loss rule: {(result.stderr.strip() or '?').splitlines()[0]}")


def drop_counts() -> tuple[int, int]:
    """(packets seen on lo, packets dropped) by the loss rule in the current namespace."""
    result = subprocess.run(["nft", "-j", "list", "table", "netdev", TABLE], text=True, capture_output=True)
    if result.returncode != 0:
        return 0, 0
    counters = [item["rule"]["expr"] for item in json.loads(result.stdout)["nftables"] if "rule" in item]
    counts = [next(e["counter"]["packets"] for e in expr if "counter" in e) for expr in counters]
    return (counts + [0, 0])[0], (counts + [0, 0])[1]


def _child_main(engine_path: str, config_json: str, progress: str, error_fd: str) -> int:
    """The child's side of ``run_in_namespace``: lo up and lossy, the engine ``module:function`` runs
    the config, and the drop counts join its results; an error goes to ``error_fd`` as one line."""
    module, _, name = engine_path.partition(":")
    engine: Engine = getattr(importlib.import_module(module), name)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    with os.fdopen(int(error_fd), "w") as errors:
        try:
            config = ExperimentConfig(**json.loads(config_json))
            _loopback_up()
            install_drop_rule(config.net.loss)
            result = engine(config, progress=progress == "1")
            seen, dropped = drop_counts()
            (result.output / "kernel_loss.json").write_text(json.dumps({
                "configured_loss": config.net.loss, "packets_on_lo": seen,
                "packets_dropped": dropped, "measured_loss": dropped / seen if seen else None,
            }, indent=2))
        except MeshlearnError as exc:
            errors.write(str(exc))
            return exc.exit_code
        except KeyboardInterrupt:
            return 130
    return 0


if __name__ == "__main__":  # its end as prompt as the command's: the parent's Ctrl-C waits for it
    exit_now(_child_main(*sys.argv[1:5]))
