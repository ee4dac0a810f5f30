"""Secure aggregation's cores (``privacy.secagg``, ``privacy.masking``) by hand: masks cancel in the
sum, dropped members' masks are removed with their shared keys, a survivor that dies before it
reveals is rebuilt from the others' shares, a member never reveals a seed and a key of the same
member, tampered shares do not open; and the settings that cannot go with it are refused in one line."""

import numpy as np
import pytest
import torch

from meshlearn.config import ExperimentConfig
from meshlearn.errors import ConfigError, WireError
from meshlearn.privacy.masking import combine, decode, encode, new_seed, split
from meshlearn.privacy.secagg import MaskedPush, SecureCycle, SecureMember

LENGTH = 5001


def _group(members):
    """Members that met and offered their first keys (cycle 0), as the setup rounds leave them."""
    people = {rank: SecureMember(rank) for rank in members}
    identities = {rank: person.identity.public for rank, person in people.items()}
    for person in people.values():
        person.meet(identities)
    setup = SecureCycle(-1, members, {}, 0)
    for rank, person in people.items():
        setup.add(rank, MaskedPush(None, (), person.offer(0, members)))
    setup.survivors = sorted(setup.offers)
    for rank, person in people.items():
        person.accept(0, setup.offered_to(rank))
    return people, setup.next_publics()


def _contributions(members, seed=0):
    rng = np.random.default_rng(seed)
    return {m: np.append(rng.normal(size=LENGTH - 1) * (m + 1), float(10 * (m + 1))) for m in members}


def _unmask(people, cycle_book, revealers):
    survivors, dropped = cycle_book.close()
    for rank in revealers:
        seeds, keys = people[rank].reveal(cycle_book.cycle, 0, survivors, dropped, cycle_book.sealed_for(rank))
        cycle_book.add_reveal(rank, seeds, keys)
    return decode(cycle_book.total())


def test_encoding_and_shamir_round_trip():
    values = np.array([0.0, 1.5, -2.25, 1e6, -3e-7])
    assert np.allclose(decode(encode(values)), values, atol=1e-6)
    secret = new_seed()
    shares = split(secret, 3, 5)
    assert combine(shares[1:4]) == secret and combine([shares[0], shares[2], shares[4]]) == secret
    assert combine(shares[:2]) != secret  # below the threshold: another secret


def test_pairwise_masks_cancel_and_hide_each_model():
    members = [0, 1, 2, 3]
    people, publics = _group(members)
    values = _contributions(members)
    book = SecureCycle(0, members, publics, LENGTH)
    for rank in members:
        book.add(rank, people[rank].mask(0, values[rank], members, publics))
        seen = decode(book.masked[rank])
        assert abs(seen @ values[rank]) / np.linalg.norm(seen) / np.linalg.norm(values[rank]) < 0.1
    # the masked models alone, summed, already cancel every pairwise mask; the self masks remain
    total = _unmask(people, book, members)
    assert np.abs(total - sum(values.values())).max() < 1e-5
    assert book.dropped == [] and book.next_publics().keys() == set(members)


def test_a_dropped_members_masks_are_removed_and_a_silent_survivor_is_rebuilt():
    members = [0, 1, 2, 3, 4]
    people, publics = _group(members)
    values = _contributions(members, seed=1)
    book = SecureCycle(0, members, publics, LENGTH)
    for rank in members[:-1]:  # member 4 never pushes
        book.add(rank, people[rank].mask(0, values[rank], members, publics))
    survivors, dropped = book.close()
    assert survivors == [0, 1, 2, 3] and dropped == [4]
    with pytest.raises(ValueError, match="not ready"):
        book.total()
    total = _unmask(people, book, [0, 1, 2])  # member 3 pushed, then died before revealing: 3 of 4 suffice
    assert np.abs(total - sum(values[m] for m in survivors)).max() < 1e-5
    # the next cycle is the survivors', with the keys they offered
    assert set(book.next_publics()) == set(survivors)


def test_too_few_survivors_or_revealers_cannot_unmask():
    members = [0, 1, 2, 3, 4]
    people, publics = _group(members)
    values = _contributions(members, seed=2)
    book = SecureCycle(0, members, publics, LENGTH)
    for rank in members[:3]:
        book.add(rank, people[rank].mask(0, values[rank], members, publics))
    book.close()
    assert book.enough()  # 3 survivors, threshold 3
    seeds, keys = people[0].reveal(0, 0, book.survivors, book.dropped, book.sealed_for(0))
    book.add_reveal(0, seeds, keys)
    assert not book.ready()  # one revealer of the 3 needed


def test_a_member_never_reveals_a_seed_and_a_key_of_one_member():
    members = [0, 1, 2]
    people, publics = _group(members)
    values = _contributions(members)
    book = SecureCycle(0, members, publics, LENGTH)
    for rank in members:
        book.add(rank, people[rank].mask(0, values[rank], members, publics))
    book.close()
    people[1].reveal(0, 0, [0, 1, 2], [], book.sealed_for(1))
    with pytest.raises(WireError, match="second unmasking"):  # the same leader asking again, 2 now dropped
        people[1].reveal(0, 0, [0, 1], [2], [])
    with pytest.raises(WireError, match="both as survivors and as dropped"):
        people[2].reveal(0, 0, [0, 1, 2], [2], [])


def test_tampered_or_misaddressed_shares_are_refused():
    members = [0, 1, 2]
    people, publics = _group(members)
    book = SecureCycle(0, members, publics, LENGTH)
    for rank in members:
        book.add(rank, people[rank].mask(0, _contributions(members)[rank], members, publics))
    book.close()
    sealed = book.sealed_for(1)
    broken = bytearray(sealed[0])
    broken[-1] ^= 1
    with pytest.raises(WireError, match="does not open"):
        people[1].reveal(0, 0, [0, 1, 2], [], [bytes(broken)] + sealed[1:])
    with pytest.raises(WireError, match="not a survivor's for 2"):
        people[2].reveal(0, 0, [0, 1, 2], [], sealed)
    with pytest.raises(WireError, match="not one of cycle 0's members"):
        book.add(7, people[0].mask(0, _contributions(members)[0], members, publics))


@pytest.mark.parametrize("changes, message", [
    ({"aggregation": "krum:1"}, "needs aggregation mean (krum:1 needs each member's model"),
    ({"leader_sync": False}, "needs leader_sync true"),
    ({"algorithm": "fedavg"}, "needs algorithm leader with leader_sync true"),
    ({"engine": "batched"}, "needs engine process"),
    ({"nodes": 2}, "needs at least 3 nodes"),
    ({"byzantine": "1:sign-flip"}, "needs no byzantine nodes"),
])
def test_settings_secure_aggregation_cannot_go_with_are_refused_in_one_line(changes, message):
    settings = {"algorithm": "leader", "leader_sync": True, "secure_aggregation": True, "nodes": 4, **changes}
    with pytest.raises(ConfigError) as caught:
        ExperimentConfig(**settings)
    assert message in str(caught.value) and "or use secure_aggregation false" in str(caught.value)


def test_a_network_request_refuses_secure_aggregation_where_it_cannot_run():
    from meshlearn.network.task.spec import TaskRequest

    base = {"data": "digits", "algorithm": "fedavg", "providers": 4, "leader": {"secure": True}}
    assert TaskRequest(**base).leader.secure
    for changes, message in [({"aggregation": "median"}, "needs aggregation mean"),
                             ({"algorithm": "gossip"}, "needs algorithm fedavg or leader"),
                             ({"algorithm": "leader"}, "needs --leader-sync true"),
                             ({"providers": 2}, "at least 3 providers"),
                             ({"min_providers": 3}, "leave --min-providers out")]:
        with pytest.raises((ValueError, ConfigError), match=message):
            TaskRequest(**{**base, **changes})


def test_a_dropped_member_offers_a_key_and_is_back_the_cycle_after():
    members = [0, 1, 2, 3]
    people, publics = _group(members)
    values = _contributions(members, seed=3)
    first = SecureCycle(0, members, publics, LENGTH)
    for rank in members[:3]:  # member 3 is late: dropped from cycle 0
        first.add(rank, people[rank].mask(0, values[rank], members, publics))
    _unmask(people, first, [0, 1, 2])
    first.add(3, people[3].mask(0, values[3], members, publics))  # its late push changes nothing
    assert sorted(first.next_publics()) == [0, 1, 2]
    for rank in members:
        people[rank].accept(1, first.offered_to(rank))
    second = SecureCycle(1, [0, 1, 2], first.next_publics(), LENGTH)
    for rank in [0, 1, 2]:
        second.add(rank, people[rank].mask(1, values[rank], [0, 1, 2], second.publics))
    second.add(3, people[3].observe(1, [0, 1, 2]))  # no model, only its key for cycle 2
    assert np.abs(_unmask(people, second, [0, 1, 2]) - sum(values[m] for m in [0, 1, 2])).max() < 1e-5
    assert sorted(second.next_publics()) == [0, 1, 2, 3]
    for rank in members:
        people[rank].accept(2, second.offered_to(rank))
    third = SecureCycle(2, members, second.next_publics(), LENGTH, key_holders=second.next_holders())
    for rank in [0, 1, 3]:  # back, and now member 2 drops: its key, offered in cycle 1, is rebuilt
        third.add(rank, people[rank].mask(2, values[rank], members, third.publics))
    assert np.abs(_unmask(people, third, [0, 1, 3]) - sum(values[m] for m in [0, 1, 3])).max() < 1e-5


def test_the_leaders_book_takes_a_session_through_its_cycles_and_sends_a_lagging_member_the_newest_model():
    """``SecureBook`` (the leader's side): setup, four cycles with every member, then a push of a cycle
    the book no longer keeps is told so (the leader answers it with the newest aggregate)."""
    from meshlearn.node.algorithms.secure import SecureBook, StaleCycle, weighted_mean

    members = [0, 1, 2]
    people = {rank: SecureMember(rank) for rank in members}
    book = SecureBook(LENGTH, alive=lambda member: True, limit=4)
    for rank, person in people.items():
        book.meet(rank, person.identity.public)
    identities = book.everyone_met(members)
    for rank, person in people.items():
        person.meet(identities)
        book.offer(rank, 0, person.offer(0, members))
    setup = book.setup_done()
    publics = setup.next_publics()
    for rank, person in people.items():
        person.accept(0, setup.offered_to(rank))
    values = _contributions(members, seed=4)
    for cycle in range(4):
        for rank in members:
            book.push(rank, cycle, people[rank].mask(cycle, values[rank], members, publics))
        closed = book.close(cycle)
        for rank in members:
            seeds, keys = people[rank].reveal(cycle, 0, closed.survivors, closed.dropped, closed.sealed_for(rank))
            book.reveal(rank, cycle, seeds, keys)
        known, total = book.total(cycle)
        expected = sum(values.values())
        assert known and np.abs(total - expected).max() < 1e-5
        model = book.model(cycle, lambda: weighted_mean(total, torch.float32))
        assert torch.allclose(model, torch.from_numpy(expected[:-1] / expected[-1]).float(), atol=1e-5)
        publics = closed.next_publics()
        for rank in members:
            people[rank].accept(cycle + 1, closed.offered_to(rank))
    with pytest.raises(StaleCycle):
        book.push(1, 0, people[1].observe(0, members))
    assert book.latest()[1].cycle == 3


def test_a_cycle_whose_dropped_key_has_too_few_holders_left_is_not_enough():
    """Member 3 shared its key among 6 (a cycle that later lost 4 and 5): with 3 survivors of those
    6, its key (4 shares needed) cannot be rebuilt, and the cycle says so at once instead of waiting."""
    book = SecureCycle(1, [0, 1, 2, 3], {}, LENGTH, key_holders={3: [0, 1, 2, 3, 4, 5]})
    book.masked = {m: np.zeros(LENGTH, dtype=np.uint64) for m in (0, 1, 2)}
    book.close()
    assert book.dropped == [3] and not book.enough()
    shared_among_four = SecureCycle(1, [0, 1, 2, 3], {}, LENGTH, key_holders={3: [0, 1, 2, 3]},
                                    masked=dict(book.masked))
    assert not shared_among_four.enough()  # not closed yet
    shared_among_four.close()
    assert shared_among_four.enough()  # 3 of its 4 holders survive


def test_a_low_order_public_key_is_refused():
    from meshlearn.privacy.masking import check_public

    good = SecureMember(0).identity.public
    assert check_public(good) == good
    for bad in (bytes(32), (1).to_bytes(32, "little"), b"short"):
        with pytest.raises(WireError):
            check_public(bad)
