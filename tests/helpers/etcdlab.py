"""etcd members on loopback for tests of a registry several bootstraps share: started, found ready,
and always stopped (every member also dies with the test process: PR_SET_PDEATHSIG)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.netproc import free_port

from meshlearn.network.bootstrap.etcd import Delete, EtcdClient, EtcdTls
from meshlearn.network.bootstrap.etcdcluster import (
    EtcdMember,
    MemberSpec,
    client_urls,
    etcd_binary,
    missing_etcd_message,
)
from meshlearn.network.bootstrap.etcdstore import ROOT
from meshlearn.network.bootstrap.registrystore import EtcdLocation

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason=missing_etcd_message())
READY = 30.0  # seconds a member (or a new leader) may take on a busy machine: generous, never the point


def member_specs(root: Path, count: int) -> list[MemberSpec]:
    """``count`` members on loopback, each with a client port and the peer port after it, all distinct."""
    ports: set[int] = set()
    specs = []
    while len(specs) < count:
        port = free_port()  # port + 1 is free too
        if {port, port + 1} & ports:
            continue
        ports |= {port, port + 1}
        specs.append(MemberSpec(f"m{len(specs)}", "127.0.0.1", port, port + 1, root / f"m{len(specs)}"))
    return specs


def start_members(specs: list[MemberSpec], tls: EtcdTls | None) -> list[EtcdMember]:
    """Start every member of ``specs`` and wait until each answers (all stopped if one cannot)."""
    members = [EtcdMember(spec, specs, tls) for spec in specs]
    try:
        for member in members:
            member.start()
        for member in members:
            member.wait_ready(READY)
    except BaseException:
        stop_members(members)
        raise
    return members


def stop_members(members: list[EtcdMember]) -> None:
    for member in members:
        member.stop()


@contextlib.contextmanager
def running_cluster(root: Path, count: int, tls: EtcdTls | None = None) -> Iterator[list[EtcdMember]]:
    """``count`` members started under ``root``, stopped on the way out whatever happened."""
    members = start_members(member_specs(root, count), tls)
    try:
        yield members
    finally:
        stop_members(members)


def fresh_registry(members: list[EtcdMember], tls_folder: Path | None = None) -> EtcdLocation:
    """The cluster of ``members`` as a registry location, its registry's keys deleted first (tests
    sharing one cluster each start from an empty registry)."""
    secure = tls_folder is not None
    urls = client_urls([m.spec for m in members], secure)
    tls = EtcdTls(tls_folder / "ca.crt", tls_folder / "client.crt", tls_folder / "client.key") if secure else None
    client = EtcdClient(urls, tls)
    try:
        client.txn([], [Delete(ROOT, prefix=True)])
    finally:
        client.close()
    return EtcdLocation(tuple(urls), tls_folder)
