"""Secure aggregation (Bonawitz et al. 2017, for an honest-but-curious leader): the pure cores of a
member's side and of the leader's, no sockets and no threads (``node.algorithms.leader`` carries them).

Each member of a cycle adds to its contribution (its weighted model, then its weight, encoded in the
ring of 2^64) a self mask from a fresh seed and, for every other member of the cycle, a pairwise mask
from their X25519 agreement (added by the lower rank, subtracted by the higher): summed over every
member the pairwise masks cancel. Before a cycle's masks are used, each member has Shamir-shared the
private key it masks with among the cycle's members (sealed with AES-GCM for each, relayed by the
leader, which cannot open them), and it shares its self-mask seed beside its masked model. Once a
cycle closes, the leader asks the survivors (those whose masked model came) for their shares of the
survivors' self-mask seeds and of the dropped members' keys: with ``threshold`` of each it removes
the self masks and the masks between survivors and dropped members, and learns the sum of the
survivors' contributions, nothing else. A member answers one set of survivors and dropped members
per cycle and leader, so it never gives a member's seed and key both.

Keys are fresh each cycle: a member offers the next cycle's key (its public half, and sealed shares
of the private half) with its masked model, and the leader hands the offers on with the cycle's
aggregate: the next cycle's members are those whose offer came before the cycle closed, its
survivors and any member a cycle before dropped (late, or counted lost for a while) that pushed no
model, only an offer, this time (``observe``): a member dropped once is back two cycles later.
Before the first cycle the members meet (each gives the long-term public key its share keys come
from) and make one offer.

What it does not protect: a leader that colludes with ``threshold`` - 1 other members (it is a member
too, and holds a share of every secret), or one that lies about who dropped out (the consistency
round of the paper's active-adversary version is not here), or members that reveal wrong shares (a
wrong aggregate, or the cycle refused, but nothing hidden is learnt); and a cycle whose survivors are
few (the sum of two models and one's own is the other): a cycle is unmasked only with at least
``MIN_MEMBERS`` survivors and ``threshold`` of them answering.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from meshlearn.errors import WireError
from meshlearn.privacy.masking import (
    OPEN_BYTES,
    KeyPair,
    check_public,
    combine,
    encode,
    new_seed,
    record_parties,
    seal,
    split,
    stream,
    unseal,
)

MIN_MEMBERS = 3  # fewer, and the leader, a member itself, would learn another member's model
KEY_SHARE, SEED_SHARE = 1, 2  # what a sealed share is of: a member's mask key for a cycle, its self-mask seed
PAIR_INFO = b"meshlearn-secagg-pair"
_OPEN = struct.Struct("<I")


def threshold_of(members: int) -> int:
    """How many shares rebuild a secret shared among ``members``: a majority."""
    return members // 2 + 1


def mask_info(cycle: int) -> bytes:
    """What binds a pairwise mask seed to its cycle."""
    return b"meshlearn-secagg-mask" + struct.pack("<q", cycle)


def pair_sign(me: int, other: int) -> int:
    """+1 where ``me`` adds the pairwise mask it shares with ``other``, -1 where it subtracts it."""
    return 1 if me < other else -1


def _enough(shares: dict[int, bytes], threshold: int) -> list[bytes]:
    """``threshold`` of the shares (by revealer): as many as rebuild the secret (Lagrange's cost grows
    with the square of the count)."""
    return [shares[revealer] for revealer in sorted(shares)[:threshold]]


def _index(share: bytes) -> int:
    """A Shamir share's index (which holder's it is)."""
    return struct.unpack_from("<H", share)[0] if len(share) >= 2 else 0


def open_record(sender: int, share: bytes) -> bytes:
    """A share in the clear, as a member reveals it to the leader: whose secret it is of, then the share."""
    return _OPEN.pack(sender) + share


def read_open(record: bytes) -> tuple[int, bytes]:
    """``open_record``'s owner and share."""
    if len(record) != OPEN_BYTES:
        raise WireError(f"a revealed share is {OPEN_BYTES} bytes, not {len(record)}")
    return _OPEN.unpack_from(record)[0], record[_OPEN.size:]


@dataclass(frozen=True)
class Offer:
    """A member's key for a cycle: the public half, and the private half's sealed shares, one for
    each member of the cycle it is offered in."""

    public: bytes
    sealed: tuple[bytes, ...]


@dataclass(frozen=True)
class MaskedPush:
    """What a member gives for a cycle: its masked contribution (``uint64``, None where the member is
    not one of the cycle's: it only offers its next key), its self-mask seed's sealed shares, and
    its offer for the next cycle."""

    masked: np.ndarray | None
    sealed_seed: tuple[bytes, ...]
    offer: Offer


class SecureMember:
    """One member's side: its long-term identity (share keys), its mask keys by cycle, and the
    shares of other members' mask keys it holds."""

    def __init__(self, rank: int):
        self.rank = rank
        self.identity = KeyPair.generate()
        self._pair_keys: dict[int, bytes] = {}
        self._keys: dict[int, KeyPair] = {}  # cycle -> the key this member masks with
        self._held: dict[tuple[int, int], bytes] = {}  # (cycle, owner) -> this member's share of owner's key
        self._answered: dict[tuple[int, int], tuple[frozenset[int], frozenset[int]]] = {}

    def meet(self, identities: dict[int, bytes]) -> None:
        """Learn the members' long-term public keys: one share key with each, from key agreement."""
        for member, public in identities.items():
            if member not in self._pair_keys:
                self._pair_keys[member] = self.identity.agree(public, PAIR_INFO)

    def offer(self, cycle: int, members: list[int]) -> Offer:
        """A fresh key for ``cycle``, its private half shared among ``members`` (this one too)."""
        members = sorted(members)
        keys = self._keys[cycle] = KeyPair.generate()
        for old in [c for c in self._keys if c < cycle - 1]:
            del self._keys[old]
        shares = split(keys.private_bytes(), threshold_of(len(members)), len(members))
        return Offer(keys.public, tuple(seal(self._key_for(m), KEY_SHARE, cycle, self.rank, m, share)
                                        for m, share in zip(members, shares)))

    def accept(self, cycle: int, sealed: list[bytes]) -> None:
        """Keep this member's shares of the other members' ``cycle`` keys (records sealed for it)."""
        for old in [key for key in self._held if key[0] < cycle - 1]:
            del self._held[old]
        for record in sealed:
            sender, recipient = record_parties(record)
            if recipient != self.rank:
                raise WireError(f"a key share for {recipient} handed to {self.rank}")
            _, share = unseal(self._key_for(sender), KEY_SHARE, cycle, record)
            self._held[(cycle, sender)] = share

    def mask(self, cycle: int, contribution: np.ndarray, members: list[int], publics: dict[int, bytes]
             ) -> MaskedPush:
        """``contribution`` (floats) masked for ``cycle`` among ``members`` (whose keys are ``publics``),
        the self-mask seed's sealed shares, and the offer of the next cycle's key among them."""
        members = sorted(members)
        if self.rank not in members or cycle not in self._keys:
            raise ValueError(f"member {self.rank} is not one of cycle {cycle}'s secure aggregation")
        masked = encode(contribution)
        seed = new_seed()
        masked += stream(seed, masked.size)
        keys, info = self._keys[cycle], mask_info(cycle)
        for other in members:
            if other == self.rank:
                continue
            pair = stream(keys.agree(publics[other], info), masked.size)
            if pair_sign(self.rank, other) > 0:
                masked += pair
            else:
                masked -= pair
        shares = split(seed, threshold_of(len(members)), len(members))
        sealed = tuple(seal(self._key_for(m), SEED_SHARE, cycle, self.rank, m, share)
                       for m, share in zip(members, shares))
        return MaskedPush(masked, sealed, self.offer(cycle + 1, members))

    def observe(self, cycle: int, members: list[int]) -> MaskedPush:
        """A push for ``cycle`` by a member that is not one of its members: no contribution, only the
        next cycle's key offered among ``members`` and this member."""
        return MaskedPush(None, (), self.offer(cycle + 1, sorted({*members, self.rank})))

    def reveal(self, cycle: int, leader: int, survivors: list[int], dropped: list[int], sealed_seeds: list[bytes]
               ) -> tuple[list[bytes], list[bytes]]:
        """Answer ``leader``'s unmasking of ``cycle``: this member's shares of the survivors' self-mask
        seeds (opened from ``sealed_seeds``) and of the dropped members' keys. Refused where the two
        sets overlap, or where this leader asked about the cycle before with other sets."""
        asked = (frozenset(survivors), frozenset(dropped))
        if asked[0] & asked[1]:
            raise WireError(f"an unmasking of cycle {cycle} that counts member(s) {sorted(asked[0] & asked[1])} "
                            "both as survivors and as dropped")
        if self._answered.setdefault((cycle, leader), asked) != asked:
            raise WireError(f"a second unmasking of cycle {cycle} with other members")
        seeds = []
        for record in sealed_seeds:
            sender, recipient = record_parties(record)
            if recipient != self.rank or sender not in asked[0]:
                raise WireError(f"a seed share of {sender} for {recipient}, not a survivor's for {self.rank}")
            seeds.append(open_record(sender, unseal(self._key_for(sender), SEED_SHARE, cycle, record)[1]))
        keys = [open_record(member, self._held[(cycle, member)]) for member in sorted(asked[1])
                if (cycle, member) in self._held]
        return seeds, keys

    def _key_for(self, member: int) -> bytes:
        if member not in self._pair_keys:
            raise WireError(f"member {self.rank} has no share key with {member} (it did not meet it)")
        return self._pair_keys[member]


@dataclass
class SecureCycle:
    """The leader's side of one cycle: the masked contributions of its ``members`` (whose keys are
    ``publics``) as they come, then, once ``close``d, the survivors' revealed shares, and the sum."""

    cycle: int
    members: list[int]
    publics: dict[int, bytes]
    length: int  # ring elements in a contribution
    key_holders: dict[int, list[int]] = field(default_factory=dict)  # member -> those it shared its key among
    # (sorted; share i is the i-th one's), where not this cycle's members (a member back from a drop)
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    offers: dict[int, Offer] = field(default_factory=dict)
    survivors: list[int] | None = None
    dropped: list[int] = field(default_factory=list)
    _seeds: dict[int, list[bytes]] = field(default_factory=dict)  # recipient -> sealed seed shares for it
    _seed_shares: dict[int, dict[int, bytes]] = field(default_factory=dict)  # survivor -> revealer -> share
    _key_shares: dict[int, dict[int, bytes]] = field(default_factory=dict)  # dropped -> revealer -> share
    revealed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.members = sorted(self.members)
        self.threshold = threshold_of(len(self.members))

    def holders(self, member: int) -> list[int]:
        """Those who hold shares of ``member``'s key for this cycle (sorted)."""
        return self.key_holders.get(member, self.members)

    def key_threshold(self, member: int) -> int:
        """How many shares rebuild ``member``'s key: a majority of its holders."""
        return threshold_of(len(self.holders(member)))
    def add(self, member: int, push: MaskedPush) -> None:
        """Record ``member``'s push (once; pushes after ``close`` only offer keys). A WireError where
        it does not fit the cycle."""
        contributes = push.masked is not None
        if contributes and member not in self.members:
            raise WireError(f"a masked model from {member}, not one of cycle {self.cycle}'s members")
        if contributes and (push.masked.dtype != np.uint64 or push.masked.shape != (self.length,)):
            raise WireError(f"a masked model of {push.masked.shape} {push.masked.dtype}, expected ({self.length},) "
                            "uint64")
        check_public(push.offer.public)
        self._check_sealed(member, push.sealed_seed if contributes else (), contributes)
        offered_to = sorted(record_parties(record)[1] for record in push.offer.sealed)
        if any(record_parties(record)[0] != member for record in push.offer.sealed) or \
                offered_to != sorted({*self.members, member}):
            raise WireError(f"{member}'s key shares are not one for each member of cycle {self.cycle} (and itself)")
        if self.survivors is not None or member in self.offers:
            return  # late, or again: the first push of a cycle counts
        self.offers[member] = push.offer
        if contributes:
            self.masked[member] = push.masked
            for record in push.sealed_seed:
                self._seeds.setdefault(record_parties(record)[1], []).append(record)

    def _check_sealed(self, member: int, sealed: tuple[bytes, ...], contributes: bool) -> None:
        recipients = [record_parties(record) for record in sealed]
        if contributes and sorted(r for _, r in recipients) != self.members:
            raise WireError(f"{member}'s seed shares are not one for each member of cycle {self.cycle}")
        if any(sender != member for sender, _ in recipients):
            raise WireError(f"{member} handed seed shares in another member's name")

    def close(self) -> tuple[list[int], list[int]]:
        """Fix the survivors (members whose masked model came) and the dropped members (the others)."""
        if self.survivors is None:
            self.survivors = sorted(self.masked)
            self.dropped = [m for m in self.members if m not in self.masked]
        return self.survivors, self.dropped

    @property
    def closed(self) -> bool:
        """Whether ``close`` fixed the survivors."""
        return self.survivors is not None

    def enough(self, alive: set[int] | None = None) -> bool:
        """Whether the survivors (those of them ``alive``, where given) are enough to unmask the cycle:
        ``MIN_MEMBERS``, and the threshold of every secret the sum needs among those holding its shares."""
        if self.survivors is None:
            return False
        able = set(self.survivors) if alive is None else set(self.survivors) & alive
        able |= self.revealed
        return len(self.survivors) >= MIN_MEMBERS and len(able) >= self.threshold and all(
            len(able & set(self.holders(d))) >= self.key_threshold(d) for d in self.dropped)

    def sealed_for(self, member: int) -> list[bytes]:
        """The survivors' sealed seed shares for ``member`` (what it is asked to open)."""
        survivors = set(self.survivors or ())
        return [record for record in self._seeds.get(member, []) if record_parties(record)[0] in survivors]

    def add_reveal(self, member: int, seeds: list[bytes], keys: list[bytes]) -> None:
        """Record what survivor ``member`` revealed (once)."""
        if self.survivors is None or member not in self.survivors or member in self.revealed:
            return
        opened_seeds, opened_keys = {}, {}
        for record in seeds:
            owner, share = read_open(record)
            if owner not in self.survivors or _index(share) != self.members.index(member) + 1:
                raise WireError(f"{member} revealed a seed share of {owner} that is not a survivor's, or not its own")
            opened_seeds[owner] = share
        for record in keys:
            owner, share = read_open(record)
            holders = self.holders(owner)
            if owner not in self.dropped or member not in holders or _index(share) != holders.index(member) + 1:
                raise WireError(f"{member} revealed a key share of {owner} that is not a dropped member's, or not "
                                "its own")
            opened_keys[owner] = share
        for owner, share in opened_seeds.items():  # all or nothing: a reveal refused leaves no trace
            self._seed_shares.setdefault(owner, {})[member] = share
        for owner, share in opened_keys.items():
            self._key_shares.setdefault(owner, {})[member] = share
        self.revealed.add(member)

    def ready(self) -> bool:
        """Whether the shares revealed so far rebuild every secret the sum needs."""
        return self.enough() and len(self.revealed) >= self.threshold \
            and all(len(self._seed_shares.get(m, {})) >= self.threshold for m in self.survivors) \
            and all(len(self._key_shares.get(m, {})) >= self.key_threshold(m) for m in self.dropped)

    def total(self) -> np.ndarray:
        """The sum of the survivors' contributions (``uint64``), once ``ready``."""
        if not self.ready():
            raise ValueError(f"cycle {self.cycle} is not ready to unmask")
        total = np.zeros(self.length, dtype=np.uint64)
        for member in self.survivors:
            total += self.masked[member]
            total -= stream(combine(_enough(self._seed_shares[member], self.threshold)), self.length)
        info = mask_info(self.cycle)
        for member in self.dropped:
            keys = KeyPair.from_private(combine(_enough(self._key_shares[member], self.key_threshold(member))))
            if keys.public != self.publics.get(member):
                raise WireError(f"the shares of {member}'s key rebuild another key")
            for survivor in self.survivors:
                pair = stream(keys.agree(self.publics[survivor], info), self.length)
                if pair_sign(survivor, member) > 0:  # the survivor added it: take it away
                    total -= pair
                else:
                    total += pair
        return total

    def next_publics(self) -> dict[int, bytes]:
        """The next cycle's members and their offered keys: the survivors, and the members outside this
        cycle that offered a key in time (one the cycle before dropped: it comes back)."""
        return {m: offer.public for m, offer in sorted(self.offers.items())} if self.closed else {}

    def next_holders(self) -> dict[int, list[int]]:
        """Those each next cycle's member shared its key among."""
        return {m: sorted(record_parties(r)[1] for r in offer.sealed) for m, offer in self.offers.items()} \
            if self.closed else {}

    def offered_to(self, member: int) -> list[bytes]:
        """The next cycle's members' sealed shares of their next keys, for ``member``."""
        return [record for m, offer in sorted(self.offers.items()) for record in offer.sealed
                if record_parties(record)[1] == member] if self.closed else []
