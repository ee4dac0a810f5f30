"""Secure aggregation carried by the synchronous leader (``LeaderSettings.secure``): the members'
side (``SecurePusher``) and the leader's (``SecureBook``) around ``privacy.secagg``'s cores.

A member's first push is preceded by two rounds through the leader, each answered once every
member not lost took part: ``sa-meet`` (each gives its long-term public key, and gets everyone's)
and ``sa-offer`` (each offers its key for the first cycle, Shamir-shared among the members; it gets
the members' keys and its shares of them). Then each cycle is a push and, once the cycle closes
(every member not lost pushed it), a ``reveal``: the push carries the masked contribution (the
weighted model, then its weight), the self-mask seed's sealed shares and the next cycle's offer; its
answer asks the member to open its shares of the survivors' seeds and to give its shares of the
dropped members' keys; the reveal's answer is the cycle's aggregate (the survivors' weighted mean),
with the next cycle's members, their keys and this member's shares of them. A member the cycle
dropped (it pushed too late, or was counted lost for a while) is not one of the next cycle's: that
cycle it pushes no model, only offers its key, and takes the aggregate; the cycle after it is one of
the members again. A cycle whose survivors
are too few, or whose revealers die below the threshold, stops the run with that said.

The leader is a member like the others: its own push and reveal go to its own book.
``MESHLEARN_SECAGG_AUDIT`` (a folder): each member writes there the contribution it masked, and the
leader every masked model it received and each cycle's aggregate, by cycle (``.npy``), so that what
the leader saw can be compared with the truth (tests/test_secure_aggregation.py).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from meshlearn.errors import WireError
from meshlearn.flat import segment_ranges
from meshlearn.privacy.masking import (
    KEY_BYTES,
    OPEN_BYTES,
    SEALED_BYTES,
    check_public,
    decode,
)
from meshlearn.privacy.secagg import MaskedPush, Offer, SecureCycle, SecureMember

log = logging.getLogger(__name__)
AUDIT = "MESHLEARN_SECAGG_AUDIT"
_KEYED = 4 + KEY_BYTES  # a rank (u32), then a public key


class SecureAggregationFailed(RuntimeError):
    """A cycle that cannot be unmasked (too few survivors, or revealers)."""


class StaleCycle(WireError):
    """A push of a cycle the leader no longer keeps (a member back after it was counted lost)."""


# --- packing records into tensors (what travels) --------------------------------------------------

def pack(records: list[bytes] | tuple[bytes, ...], width: int) -> torch.Tensor:
    """Fixed-width byte records as one ``uint8`` tensor [count, width]."""
    if not records:
        return torch.zeros((0, width), dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(records)), dtype=torch.uint8).reshape(len(records), width)


def unpack(tensors: dict, name: str, width: int, limit: int) -> list[bytes]:
    """The records of ``tensors[name]`` (an absent one: none); a WireError where it is not
    [count <= ``limit``, ``width``] ``uint8``."""
    tensor = tensors.get(name)
    if tensor is None:
        return []
    if tensor.dtype != torch.uint8 or tensor.dim() != 2 or tensor.shape[1] != width or tensor.shape[0] > limit:
        raise WireError(f"{name} is {tensor.dtype} {list(tensor.shape)}, expected uint8 [<= {limit}, {width}]")
    raw = tensor.contiguous().numpy().tobytes()
    return [raw[i * width:(i + 1) * width] for i in range(tensor.shape[0])]


def pack_keys(keys: dict[int, bytes]) -> torch.Tensor:
    """Public keys by rank as [count, 36] ``uint8`` records."""
    return pack([int(rank).to_bytes(4, "little") + key for rank, key in sorted(keys.items())], _KEYED)


def unpack_keys(tensors: dict, name: str, limit: int) -> dict[int, bytes]:
    """``pack_keys``'s keys by rank."""
    return {int.from_bytes(record[:4], "little"): record[4:] for record in unpack(tensors, name, _KEYED, limit)}


def pack_ring(values: np.ndarray) -> dict[str, torch.Tensor]:
    """A ring vector (``uint64``) as the wire's named ``int64`` segments ``sa.y.N``."""
    signed = torch.from_numpy(values.view(np.int64))
    return {f"sa.y.{name.split('.')[1]}": signed[a:b] for name, (a, b) in segment_ranges(values.size, 8).items()}


def unpack_ring(tensors: dict, length: int) -> np.ndarray | None:
    """``pack_ring``'s vector of ``length`` elements (None where the push holds none); a WireError
    where its segments do not make one."""
    names = [name for name in tensors if name.startswith("sa.y.")]
    if not names:
        return None
    expected = {f"sa.y.{name.split('.')[1]}": (a, b) for name, (a, b) in segment_ranges(length, 8).items()}
    if set(names) != set(expected):
        raise WireError(f"a masked model in segments {sorted(names)[:3]}..., expected {len(expected)} of {length}")
    parts = []
    for name, (a, b) in sorted(expected.items(), key=lambda item: item[1][0]):
        part = tensors[name]
        if part.dtype != torch.int64 or part.shape != (b - a,):
            raise WireError(f"{name} is {part.dtype} {list(part.shape)}, expected int64 [{b - a}]")
        parts.append(part.contiguous().numpy())
    return np.concatenate(parts).view(np.uint64)


def push_tensors(push: MaskedPush) -> dict[str, torch.Tensor]:
    """What a secure push carries."""
    tensors = pack_ring(push.masked) if push.masked is not None else {}
    tensors.update({"sa.b": pack(push.sealed_seed, SEALED_BYTES), "sa.k": pack(push.offer.sealed, SEALED_BYTES),
                    "sa.pk": torch.frombuffer(bytearray(push.offer.public), dtype=torch.uint8)})
    return tensors


def read_push(tensors: dict, length: int, limit: int) -> MaskedPush:
    """``push_tensors``'s push (``length``: ring elements in a masked model; ``limit``: members)."""
    public = tensors.get("sa.pk")
    if public is None or public.dtype != torch.uint8 or public.shape != (KEY_BYTES,):
        raise WireError("a secure push without its offered key")
    return MaskedPush(unpack_ring(tensors, length), tuple(unpack(tensors, "sa.b", SEALED_BYTES, limit)),
                      Offer(public.numpy().tobytes(), tuple(unpack(tensors, "sa.k", SEALED_BYTES, limit))))


def audit(kind: str, cycle: int, member: int, values: np.ndarray) -> None:
    """Where ``MESHLEARN_SECAGG_AUDIT`` names a folder: ``values`` written there (see the module)."""
    folder = os.environ.get(AUDIT)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        np.save(Path(folder) / f"{kind}-{cycle}-{member}.npy", values)


# --- the leader's side ----------------------------------------------------------------------------

class SecureBook:
    """The leader's side (thread-safe): who met, the setup offers, and each cycle's ``SecureCycle``.
    ``alive(member)`` says whether the leader's book still counts a member (not lost)."""

    def __init__(self, length: int, alive: Callable[[int], bool], limit: int):
        self.length = length  # ring elements of a contribution: the model's values and its weight
        self.alive = alive
        self.limit = limit  # at most this many members
        self.identities: dict[int, bytes] = {}
        self.setup: SecureCycle | None = None
        self.cycles: dict[int, SecureCycle] = {}
        self.totals: dict[int, np.ndarray | None] = {}  # cycle -> the survivors' sum (None: no weight came)
        self.failure: str | None = None
        self._models: dict[int, torch.Tensor] = {}  # cycle -> its aggregate (the newest three)
        self._lock = threading.RLock()

    def meet(self, member: int, identity: bytes) -> None:
        """Record ``member``'s long-term public key."""
        check_public(identity)
        with self._lock:
            self.identities.setdefault(member, identity)

    def everyone_met(self, members: list[int]) -> dict[int, bytes] | None:
        """Every member's identity, once every one of ``members`` not lost gave its own."""
        with self._lock:
            if all(m in self.identities or not self.alive(m) for m in members):
                return dict(self.identities)
            return None

    def offer(self, member: int, cycle: int, offer: Offer) -> None:
        """Record ``member``'s offer of its key for ``cycle``, the first (setup)."""
        with self._lock:
            if self.setup is None:
                self.setup = SecureCycle(cycle - 1, sorted(self.identities), {}, 0)
            if self.setup.cycle != cycle - 1:
                raise WireError(f"an offer for cycle {cycle}, the group's first is {self.setup.cycle + 1}")
            self.setup.add(member, MaskedPush(None, (), offer))

    def setup_done(self) -> SecureCycle | None:
        """The setup, once every member that met and is not lost offered (closed then)."""
        with self._lock:
            setup = self.setup
            if setup is None or not all(m in setup.offers or not self.alive(m) for m in setup.members):
                return None
            setup.survivors = sorted(setup.offers)
            return setup

    def cycle(self, cycle: int) -> SecureCycle:
        """Cycle ``cycle``'s book: its members are the survivors of the cycle before."""
        with self._lock:
            if cycle not in self.cycles and self.cycles and cycle < max(self.cycles):
                raise StaleCycle(f"cycle {cycle} is behind the group's {max(self.cycles)}")
            if cycle not in self.cycles:
                before = self.cycles.get(cycle - 1) or (self.setup if self.setup and self.setup.cycle == cycle - 1
                                                        else None)
                if before is None or before.survivors is None:
                    raise WireError(f"a secure push of cycle {cycle}, which this leader cannot start (it has not "
                                    f"closed cycle {cycle - 1})")
                self.cycles[cycle] = SecureCycle(cycle, sorted(before.next_publics()), before.next_publics(),
                                                 self.length, key_holders=before.next_holders())
                for old in [c for c in self.cycles if c < cycle - 2]:
                    del self.cycles[old]
            return self.cycles[cycle]

    def push(self, member: int, cycle: int, push: MaskedPush) -> None:
        """Record ``member``'s push of ``cycle``."""
        with self._lock:
            book = self.cycle(cycle)
            book.add(member, push)
            if push.masked is not None and member in book.masked:
                audit("received", cycle, member, decode(push.masked))

    def close(self, cycle: int) -> SecureCycle:
        """Close ``cycle`` (the leader's book says every member not lost pushed it); fails the run where
        its survivors cannot be unmasked."""
        with self._lock:
            book = self.cycles[cycle]
            if not book.closed and book.close()[1]:
                log.warning("secure aggregation: cycle %d dropped member(s) %s (no masked model came); their masks "
                            "are removed with their shared keys", cycle, ", ".join(map(str, book.dropped)))
            if not book.enough():
                self._fail(f"secure aggregation: cycle {cycle} kept {len(book.survivors)} of its "
                           f"{len(book.members)} members: too few to unmask their sum (at least 3, a majority, and a "
                           "majority of those holding each dropped member's key shares; members were lost)")
            return book

    def reveal(self, member: int, cycle: int, seeds: list[bytes], keys: list[bytes]) -> None:
        """Record what ``member`` opened for ``cycle``."""
        with self._lock:
            book = self.cycles.get(cycle)
            if book is None or not book.closed:
                raise WireError(f"a reveal of cycle {cycle}, which is not being unmasked")
            book.add_reveal(member, seeds, keys)

    def total(self, cycle: int) -> tuple[bool, np.ndarray | None]:
        """(whether cycle ``cycle``'s sum is known, its sum as floats: None while unknown, or where no
        weight came). Fails the run where the survivors still to reveal are too few to finish it."""
        with self._lock:
            if cycle in self.totals:
                return True, self.totals[cycle]
            book = self.cycles.get(cycle)
            if book is None or not book.closed:
                return False, None
            if not book.ready():
                if not book.enough({m for m in book.survivors if self.alive(m)}):
                    self._fail(f"secure aggregation: too few of cycle {cycle}'s survivors are left to reveal the "
                               "shares its sum needs (members were lost)")
                return False, None
            total = decode(book.total())
            self.totals[cycle] = total if total[-1] > 0 else None
            for old in [c for c in self.totals if c < cycle - 2]:
                del self.totals[old]
            return True, self.totals[cycle]

    def latest(self) -> tuple[torch.Tensor, SecureCycle] | None:
        """The newest aggregate and the cycle it is of (None before any)."""
        with self._lock:
            made = [cycle for cycle in self._models if cycle in self.cycles]
            return (self._models[max(made)], self.cycles[max(made)]) if made else None

    def model(self, cycle: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Cycle ``cycle``'s aggregate, ``make``d once (with central DP, noised once)."""
        with self._lock:
            if cycle not in self._models:
                self._models[cycle] = make()
                audit("aggregate", cycle, 0, self._models[cycle].numpy())
                for old in [c for c in self._models if c < cycle - 2]:
                    del self._models[old]
            return self._models[cycle]

    def _fail(self, reason: str) -> None:
        self.failure = reason
        raise SecureAggregationFailed(reason)


def weighted_mean(total: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The survivors' weighted mean, from the sum of their contributions (the weighted models, then the weight)."""
    return torch.from_numpy(total[:-1] / total[-1]).to(dtype)


# --- a member's side --------------------------------------------------------------------------------

Call = Callable[[dict, dict], "object | None"]  # (meta, tensors) -> the leader's reply (a Message), None: no answer


class SecurePusher:
    """A member's side: its ``SecureMember``, the members and keys of its next cycle, and the calls
    of the setup, each cycle's push and its reveal to the leader it set up with (``call``). ``mask``
    makes a cycle's push from its contribution: the secure aggregation mechanism's ``masked_push``
    (``privacy.mechanism``)."""

    def __init__(self, rank: int, length: int, limit: int, mask: Callable[..., MaskedPush]):
        self.member = SecureMember(rank)
        self.mask = mask
        self.rank, self.length, self.limit = rank, length, limit
        self.leader: int | None = None  # the leader of the session (set up with it)
        self.members: list[int] = []  # the next cycle's
        self.publics: dict[int, bytes] = {}

    def set_up(self, leader: int, cycle: int, call: Call, group: list[int]) -> None:
        """Meet the members and offer a key for ``cycle`` through ``leader`` (the first push's)."""
        reply = _answered(call({"op": "sa-meet"}, {"sa.id": _key_tensor(self.member.identity.public)}), "meeting")
        identities = unpack_keys(reply.tensors, "sa.ids", self.limit)
        if self.rank not in identities or not set(identities) <= set(group):
            raise WireError(f"the members met ({sorted(identities)}) are not of this group ({group})")
        self.member.meet(identities)
        offer = self.member.offer(cycle, sorted(identities))
        reply = _answered(call({"op": "sa-offer", "cycle": cycle},
                               {"sa.pk": _key_tensor(offer.public), "sa.k": pack(offer.sealed, SEALED_BYTES)}), "offer")
        self._next(cycle, reply.tensors)
        self.leader = leader

    def exchange(self, cycle: int, contribution: np.ndarray, meta: dict, call: Call):
        """Push ``contribution`` (floats: the weighted model, then its weight) for ``cycle`` and unmask
        it with the others; the leader's last answer, which holds the cycle's aggregate (or says
        ``keep``: no weight came, each member keeps its own model)."""
        if self.rank in self.members:
            push = self.mask(self.member, cycle, contribution, self.members, self.publics)
            audit("sent", cycle, self.rank, contribution)
        else:  # dropped from the session: it only offers keys, and takes the aggregates
            push = self.member.observe(cycle, self.members)
        reply = _answered(call({**meta, "op": "push", "secure": True, "cycle": cycle}, push_tensors(push)), "push")
        if reply.meta.get("status") == "reveal":
            survivors, dropped = _ranks(reply.meta, "survivors", self.limit), _ranks(reply.meta, "dropped", self.limit)
            seeds, keys = self.member.reveal(cycle, self.leader, survivors, dropped,
                                             unpack(reply.tensors, "sa.b", SEALED_BYTES, self.limit))
            reply = _answered(call({"op": "reveal", "cycle": cycle}, {"sa.rb": pack(seeds, OPEN_BYTES),
                                                                      "sa.rk": pack(keys, OPEN_BYTES)}), "reveal")
        if reply.meta.get("status") != "ok":
            raise WireError(f"an answer to a secure push with status {reply.meta.get('status')!r}")
        self._next(cycle + 1, reply.tensors)
        return reply

    def _next(self, cycle: int, tensors: dict) -> None:
        self.publics = unpack_keys(tensors, "sa.pks", self.limit)
        self.members = sorted(self.publics)
        if self.rank in self.members:
            self.member.accept(cycle, unpack(tensors, "sa.k", SEALED_BYTES, self.limit))


def _key_tensor(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(key), dtype=torch.uint8)


def _answered(reply, what: str):
    """``reply``, unless the leader did not answer or said the session failed."""
    if reply is None:
        raise SecureAggregationFailed(f"secure aggregation: the leader did not answer the {what} (a secure session "
                                      "does not fail over to another leader)")
    if reply.meta.get("status") == "failed":
        raise SecureAggregationFailed(str(reply.meta.get("reason", "secure aggregation failed at the leader"))[:500])
    if reply.meta.get("status") == "refused":
        raise SecureAggregationFailed(f"secure aggregation: the leader refused the {what}: "
                                      f"{str(reply.meta.get('reason'))[:500]}")
    return reply


def _ranks(meta: dict, key: str, limit: int) -> list[int]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) > limit or not all(isinstance(v, int) and v >= 0 for v in value):
        raise WireError(f"an unmasking request whose {key} is not a list of ranks")
    return value
