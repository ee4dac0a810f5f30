"""The registry's rules (discovery, atomic claims, a claim's grace, who left), the same whichever store
keeps it: one SQLite file (one bootstrap), or an etcd cluster that several bootstraps share (each
store runs every test; etcd's skip where it is not installed). Several bootstraps are several
``Registry`` objects on the same store, each with its own connection, as separate processes have."""

from __future__ import annotations

import threading

import pytest
from helpers.etcdlab import fresh_registry, needs_etcd, running_cluster

from meshlearn.clock import FakeClock
from meshlearn.network.bootstrap.registry import ProviderInfo, Registry


@pytest.fixture(scope="module")
def etcd_member(tmp_path_factory):
    """One etcd member for the module's tests (each empties the registry's keys first)."""
    with running_cluster(tmp_path_factory.mktemp("etcd"), 1) as members:
        yield members


@pytest.fixture(params=["sqlite", pytest.param("etcd", marks=needs_etcd)])
def where(request, tmp_path):
    """Where the registry is kept: a new SQLite file, or an emptied etcd registry."""
    if request.param == "sqlite":
        return tmp_path / "r.sqlite"
    return fresh_registry(request.getfixturevalue("etcd_member"))


def _provider(i: int, device: str = "cpu", location: str = "") -> ProviderInfo:
    return ProviderInfo(f"p{i}", f"127.0.0.1:{9000 + i}", 8.0, 2 + i, device, location)


def test_discovery_prefers_gpu_then_mps_then_cpu_and_filters(where):
    reg = Registry(where).open()
    for i, (device, loc) in enumerate([("cpu", "eu"), ("mps", "eu"), ("cuda", "us"), ("cuda", "eu")]):
        reg.register(_provider(i, device, loc))
    assert [p.id for p in reg.discover(4)] == ["p3", "p2", "p1", "p0"]
    assert [p.id for p in reg.discover(2, location="eu")] == ["p3", "p1"]
    assert [p.id for p in reg.discover(1, device="cpu")] == ["p0"]
    reg.close()


def test_a_named_device_filters_any_takes_the_most_common_and_ram_and_cores_filter(where):
    """docs/network.md, "Choosing providers": --device names the only device taken (gpu is cuda)
    unless fallback lets others fill in after it; any takes the device most free providers declare
    first (CloudMesh report 4.10.3), not the GPU; RAM and cores below the asked are never taken."""
    reg = Registry(where).open()
    for i, device in enumerate(["cpu", "cpu", "cpu", "cuda"]):
        reg.register(_provider(i, device))
    reg.register(ProviderInfo("small", "127.0.0.1:9100", 0.5, 16, "cpu", ""))
    assert [p.id for p in reg.discover(4, device="gpu")] == ["p3"]
    assert [p.id for p in reg.discover(2, device="mps")] == []
    assert [p.id for p in reg.discover(3, device="cuda", fallback=True)] == ["p3", "small", "p2"]
    assert [p.id for p in reg.discover(2)] == ["small", "p2"]  # cpu: four of five declare it; most cores first
    assert [p.id for p in reg.discover(5, min_ram_gb=1)] == ["p2", "p1", "p0", "p3"]
    assert [p.id for p in reg.discover(5, min_cores=4)] == ["small", "p2", "p3"]
    taken = reg.claim("t1", "req", 3, device="cuda", min_ram_gb=1)
    assert [p.id for p in taken] == ["p3"]
    reg.close()


def test_the_registry_says_which_of_a_tasks_providers_left_since_it_was_claimed(where):
    """A provider told to leave goes once its part ends, maybe between two of the requester's
    looks: the bootstrap's history tells the requester it left (not lost)."""
    clock = FakeClock()
    reg = Registry(where, clock).open()
    for i in range(3):
        reg.register(_provider(i))
    reg.remove("p0")  # left before the task
    clock.advance(1)
    reg.claim("t1", "req", 2)
    clock.advance(1)
    reg.remove("p2")
    assert reg.left_since(["p0", "p1", "p2"], reg.task("t1")["created"]) == ["p2"]
    assert reg.left_since([], 0) == []
    assert [e["kind"] for e in reg.history(3)] == ["left", "claimed", "left"]
    reg.close()


def test_claim_race_never_gives_a_provider_twice(where):
    """Eight requesters through eight registries of one store at once (bootstraps, or processes
    sharing a file): five providers, each claimed exactly once."""
    setup = Registry(where).open()
    for i in range(5):
        setup.register(_provider(i))
    results: dict[int, list[str]] = {}
    go = threading.Barrier(8)

    def claimer(k: int) -> None:
        reg = Registry(where).open()  # its own connection, as another process would have
        go.wait()
        results[k] = [p.id for p in reg.claim(f"task{k}", f"req{k}", 2)]
        reg.close()
    threads = [threading.Thread(target=claimer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [pid for ids in results.values() for pid in ids]
    assert sorted(claimed) == [f"p{i}" for i in range(5)]  # each exactly once, all taken
    for k, ids in results.items():
        record = setup.task(f"task{k}")
        assert (record is not None) == bool(ids)
        assert record is None or sorted(m["id"] for m in record["providers"]) == sorted(ids)
    setup.close()


def test_a_claimed_provider_stays_busy_until_it_has_run_the_task(where):
    reg = Registry(where).open()
    reg.register(_provider(0))
    assert [p.id for p in reg.claim("t1", "req", 1)] == ["p0"]
    reg.heartbeat("p0", "free", None, last_task=None)  # a beat sent before the task was assigned
    assert reg.discover(1) == [] and reg.claim("t2", "other", 1) == []
    reg.heartbeat("p0", "busy", "t1", last_task="t1")
    reg.heartbeat("p0", "free", None, last_task="t1")  # ran it and is done
    assert [p.id for p in reg.discover(1)] == ["p0"]
    reg.close()


def test_a_claim_sent_again_gets_what_it_took_and_takes_nothing_more(where):
    """A claim whose answer was lost is sent again, maybe to another bootstrap: named by the same
    attempt, it gets the providers it took (none lost, none more); a new attempt of the same task
    is a resume: its providers of then are lost to it, others are taken."""
    first, second = Registry(where).open(), Registry(where).open()
    for i in range(4):
        first.register(_provider(i))
    taken = [p.id for p in first.claim("t1", "req", 2, requester_key="K", attempt="a1")]
    again = [p.id for p in second.claim("t1", "req", 2, requester_key="K", attempt="a1")]
    assert again == taken and len(taken) == 2
    assert sorted(p.id for p in first.providers() if p.status == "busy") == sorted(taken)
    resumed = [p.id for p in second.claim("t1", "req", 2, requester_key="K", attempt="a2")]
    assert not set(resumed) & set(taken)
    assert {p.id: p.status for p in first.providers()} == {**{i: "lost" for i in taken}, **{i: "busy" for i in resumed}}
    first.close()
    second.close()


def test_revocation_registration_and_expiry_are_seen_by_every_registry_of_the_store(where):
    clock = FakeClock(1000.0)
    one, other = Registry(where, clock).open(), Registry(where, clock).open()
    one.register(ProviderInfo("p0", "127.0.0.1:9000", 8.0, 2, "cpu", "", key="K0"))
    one.register(ProviderInfo("p1", "127.0.0.1:9001", 8.0, 2, "cpu", "", key="K1"))
    assert other.key_of("p0") == "K0" and not other.is_revoked("K0")
    assert one.revoke("K0") == ["p0"]
    assert other.is_revoked("K0") and other.revoked() == ["K0"] and other.key_of("p0") is None
    clock.advance(31)
    assert other.heartbeat("p1", "free", None) and one.expire(30) == []
    clock.advance(31)
    assert one.expire(30) == ["p1"] and other.providers() == []
    one.close()
    other.close()


class _LosesAnswers:
    """The etcd client of an EtcdStore, but the next ``lose`` commits lose their answers: each is
    applied (``applied``) or not, then raises AmbiguousCommit, as a leader killed mid-commit does."""

    def __init__(self, client, lose: int, applied: bool):
        self.client, self.lose, self.applied = client, lose, applied

    def __getattr__(self, name):
        return getattr(self.client, name)

    def txn(self, compares, success, failure=()):
        from meshlearn.network.bootstrap.etcd import AmbiguousCommit

        if self.lose and len(success) > 1:  # a registry commit (the fence's own write is one op)
            self.lose -= 1
            if self.applied:
                self.client.txn(compares, success, failure)
            raise AmbiguousCommit("the answer was lost")
        return self.client.txn(compares, success, failure)


@needs_etcd
@pytest.mark.parametrize("applied", [True, False])
def test_a_commit_whose_answer_was_lost_counts_once(etcd_member, applied):
    """A claim whose commit lost its answer is settled through the store's fence: applied, it is
    not run again (the provider is not set lost by a second claim of the same task); not applied,
    the fence moves on and the claim runs again, once."""
    where = fresh_registry(etcd_member)
    reg = Registry(where).open()
    reg.register(_provider(0))
    reg.register(_provider(1))
    reg.store._client = _LosesAnswers(reg.store._client, 1, applied)
    taken = [p.id for p in reg.claim("t1", "req", 1, requester_key="K")]
    assert taken == ["p1"]  # the most cores
    other = Registry(where).open()
    assert {p.id: (p.status, p.task) for p in other.providers()} == {"p1": ("busy", "t1"), "p0": ("free", None)}
    assert [e["kind"] for e in other.history(10)].count("claimed") == 1
    assert [p.id for p in reg.claim("t2", "req", 1, requester_key="K")] == ["p0"]  # the fence is right again
    reg.close()
    other.close()
