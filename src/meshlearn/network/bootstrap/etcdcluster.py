"""The etcd cluster a replicated bootstrap registry lives in: its certificates, and its members run
as child processes (Debian's ``etcd-server`` binary) that never outlive the process that started them.

A cluster with TLS has one CA, one member certificate every member shows (to clients and to its
peers: its names cover every member's host), and one client certificate for bootstraps and
operators; members accept only clients and peers the CA signed.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshlearn.errors import ConfigError, MeshlearnError
from meshlearn.network.bootstrap.etcd import EtcdClient, EtcdTls, EtcdUnavailable

CERT_DAYS = 3650  # the CA and the certificates it signs last 10 years: an expired one stops the registry
CLOCK_SKEW = datetime.timedelta(hours=1)  # certificates are valid from an hour ago (members' clocks differ)
LOCAL_NAMES = ("127.0.0.1", "localhost")  # every member certificate also names these (local clients, tests)
HEARTBEAT_MS = 100  # raft heartbeat: etcd's default
ELECTION_MS = 1000  # raft election timeout: a dead leader is replaced in about this long
STOP_GRACE = 10.0  # seconds a member has to stop after SIGTERM before it is killed
READY_POLL = 0.1  # seconds between two looks at a starting member
LOG_NAME = "etcd.log"  # a member's log, in its data folder
LOG_TAIL_BYTES = 16384  # how much of a log's end is read to explain a failed member
# run by a tiny Python before etcd: ask Linux (prctl PR_SET_PDEATHSIG = 1) for SIGKILL when the parent
# dies, leave if it died already, then become etcd (argv: parent pid, etcd's command line)
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


class EtcdMemberFailed(MeshlearnError):
    """An etcd member exited or never became ready; the message names it and ends with what its log
    said last."""


def etcd_binary() -> str | None:
    """The etcd server on PATH, or None."""
    return shutil.which("etcd")


def missing_etcd_message() -> str:
    """What to do when etcd is not installed."""
    return ("etcd is not installed (no etcd on PATH): install Debian's etcd-server "
            "(sudo apt-get install etcd-server), or put etcd 3.4 or later on PATH")


# -- certificates ---------------------------------------------------------------------------------

def make_cluster_certs(folder: Path, hosts: Sequence[str]) -> EtcdTls:
    """The certificates of a cluster whose members run on ``hosts`` (IP addresses or names), made in
    ``folder`` if they are not there: ``ca.crt``/``ca.key``, ``member.crt``/``member.key`` (server
    and peer, naming ``hosts`` and 127.0.0.1/localhost) and ``client.crt``/``client.key``; keys are
    mode 0600. Files that exist are reused (a member certificate that does not name every host is
    made again). Returns the client's TLS files; :func:`member_tls` gives the members'."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_cert, ca_key = _certificate_authority(folder)
    names = list(dict.fromkeys([*hosts, *LOCAL_NAMES]))
    member = folder / "member.crt"
    if not (member.exists() and (folder / "member.key").exists() and _names_cover(member, names)):
        _issue(folder, "member", ca_cert, ca_key, names,
               [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    if not ((folder / "client.crt").exists() and (folder / "client.key").exists()):
        _issue(folder, "client", ca_cert, ca_key, [], [ExtendedKeyUsageOID.CLIENT_AUTH])
    return EtcdTls(ca=folder / "ca.crt", cert=folder / "client.crt", key=folder / "client.key")


def member_tls(folder: Path) -> EtcdTls:
    """The TLS files a member of the cluster whose certificates are in ``folder`` runs with."""
    folder = Path(folder)
    return EtcdTls(ca=folder / "ca.crt", cert=folder / "member.crt", key=folder / "member.key")


def _certificate_authority(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The cluster's CA in ``folder``, made if neither of its files is there."""
    cert_path, key_path = folder / "ca.crt", folder / "ca.key"
    if cert_path.exists() != key_path.exists():
        present, absent = (cert_path, key_path) if cert_path.exists() else (key_path, cert_path)
        raise ConfigError(f"{present} is there but {absent} is not: restore it, or remove {folder} "
                          "to make a new cluster CA (every member then needs the new certificates)")
    if cert_path.exists():
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot read the cluster CA in {folder} ({exc}): restore ca.crt and ca.key") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{key_path} is not an EC key: restore the cluster's ca.key")
        return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshlearn registry etcd CA")])
    cert = (_builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    _write_key(key_path, key)
    _write_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _issue(folder: Path, stem: str, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
           names: Sequence[str], usages: list[x509.ObjectIdentifier]) -> None:
    """Write ``stem``.key and ``stem``.crt: a new key, and a certificate the CA signs for ``names``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshlearn registry etcd {stem}")])
    builder = (_builder(subject, ca_cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(name) for name in names]),
                                        critical=False)
    _write_key(folder / f"{stem}.key", key)
    _write_file(folder / f"{stem}.crt", builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM),
                0o644)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _names_cover(cert_path: Path, names: Sequence[str]) -> bool:
    """Whether the certificate in ``cert_path`` names every one of ``names`` (False if unreadable)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        named = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    return all(_general_name(name) in named for name in names)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    _write_file(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()), 0o600)


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """``path`` holds ``data`` (with ``mode`` from its creation on) or what it held before, never part."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path} ({exc.strerror or exc}): give a folder you can write") from None


# -- members --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemberSpec:
    """One member of an etcd cluster: its name, the host others reach it at, its client and peer
    ports, and the folder it keeps its data (and its log) in."""

    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path

    def client_url(self, tls: bool = False) -> str:
        """The URL clients reach this member at (https with ``tls``)."""
        return _url(tls, self.host, self.client_port)

    def peer_url(self, tls: bool = False) -> str:
        """The URL the other members reach this member at (https with ``tls``)."""
        return _url(tls, self.host, self.peer_port)


def client_urls(cluster: Sequence[MemberSpec], tls: bool = False) -> list[str]:
    """Every member's client URL: the endpoints of a client of the cluster."""
    return [spec.client_url(tls) for spec in cluster]


class EtcdMember:
    """One etcd process, started by start(), stopped by stop(); never outlives its owner.

    ``cluster``: every member of the cluster (this one included); ``tls``: the members' TLS files
    (:func:`member_tls`), or None for plain HTTP on trusted networks only. The child gets SIGKILL
    when the thread that started it exits (Linux), so start members from a thread that lives as
    long as they should."""

    def __init__(self, spec: MemberSpec, cluster: Sequence[MemberSpec], tls: EtcdTls | None, binary: str = "etcd"):
        self.spec, self.cluster, self.tls, self.binary = spec, list(cluster), tls, binary
        self._process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path:
        return Path(self.spec.data_dir) / LOG_NAME

    def start(self) -> None:
        """Start the member (a new cluster's member, or with its data folder's state if it has one)."""
        if self.alive:
            return
        binary = shutil.which(self.binary)
        if binary is None:
            raise ConfigError(missing_etcd_message())
        data_dir = Path(self.spec.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = {name: value for name, value in os.environ.items() if not name.startswith("ETCD_")}
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(dying_with_this_process([binary, *self.arguments()]),
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)

    def arguments(self) -> list[str]:
        """etcd's command line for this member."""
        secure, spec = self.tls is not None, self.spec
        existing = (Path(spec.data_dir) / "member").is_dir()
        initial = ",".join(f"{member.name}={member.peer_url(secure)}" for member in self.cluster)
        arguments = [
            "--name", spec.name, "--data-dir", str(spec.data_dir), "--logger", "zap",
            "--listen-client-urls", _url(secure, _listen_host(spec.host), spec.client_port),
            "--advertise-client-urls", spec.client_url(secure),
            "--listen-peer-urls", _url(secure, _listen_host(spec.host), spec.peer_port),
            "--initial-advertise-peer-urls", spec.peer_url(secure),
            "--initial-cluster", initial, "--initial-cluster-state", "existing" if existing else "new",
            "--initial-cluster-token", "meshlearn-" + hashlib.sha256(initial.encode()).hexdigest()[:16],
            "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS)]
        if self.tls is not None:
            ca, cert, key = str(self.tls.ca), str(self.tls.cert), str(self.tls.key)
            arguments += ["--cert-file", cert, "--key-file", key, "--client-cert-auth", "--trusted-ca-file", ca,
                          "--peer-cert-file", cert, "--peer-key-file", key, "--peer-client-cert-auth",
                          "--peer-trusted-ca-file", ca]
        return arguments

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Return once the member answers clients; EtcdMemberFailed if it exits or has not in
        ``timeout`` seconds. A new cluster's member answers only once most members have started."""
        client = EtcdClient([self.spec.client_url(self.tls is not None)], tls=self.tls, timeout=1.0, deadline=1.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if not self.alive:
                    code = None if self._process is None else self._process.returncode
                    raise EtcdMemberFailed(f"etcd member {self.spec.name} exited (status {code}): "
                                           f"{self.last_log_line()}")
                try:
                    client.status(client.endpoints[0])
                    return
                except EtcdUnavailable:
                    if time.monotonic() >= deadline:
                        raise EtcdMemberFailed(
                            f"etcd member {self.spec.name} did not answer at {self.spec.client_url(self.tls is not None)} "
                            f"in {timeout:g} s (a new cluster's member waits for most of the others): "
                            f"{self.last_log_line()}") from None
                time.sleep(READY_POLL)
        finally:
            client.close()

    def kill(self) -> None:
        """Kill the member at once (SIGKILL: as a crash would) and reap it."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        """Stop the member: SIGTERM, then SIGKILL if it has not exited after STOP_GRACE seconds."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(STOP_GRACE)
        self.kill()

    def last_log_line(self) -> str:
        """What the member's log says last: its last error if it wrote one, else its last line."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return f"no log at {self.log_path}"
        lines = [line.strip() for line in lines if line.strip()]
        for line in reversed(lines):
            said = _log_error(line)
            if said:
                return f"{said} (see {self.log_path})"
        return f"{lines[-1][:300] if lines else 'its log is empty'} (see {self.log_path})"


def _log_error(line: str) -> str | None:
    """The message and error of a zap JSON log line of level error or worse, else None."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict) or entry.get("level") not in ("error", "fatal", "panic"):
        return None
    said = " ".join(str(entry.get(field, "")) for field in ("msg", "error")).strip()
    return said[:300] or None


def _url(tls: bool, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def _listen_host(host: str) -> str:
    """The address a member listens at: its host if that is an IP address (etcd binds only to IP
    addresses), else every interface."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "0.0.0.0"
    return host


def dying_with_this_process(command: list[str]) -> list[str]:
    """``command`` run so that it gets SIGKILL when the thread that starts it exits (Linux): through
    a tiny Python that asks for PR_SET_PDEATHSIG, which exec keeps, then becomes ``command``. (A
    preexec_fn would do it in the forked child, which can deadlock in a process with threads.)"""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *command]
