"""Which key the bootstrap must prove: pinned on the command line (``HOST:PORT@KEY``), or learnt on
first use and kept in a known-bootstraps file, as SSH keeps ``known_hosts``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshlearn.errors import AuthError, KeyMismatch, KeyRefused, NetworkError, Unreachable, UserInputError
from meshlearn.network.channel.identity import (
    fingerprint,
    key_from_text,
    key_text,
    pinned,
    split_pinned,
    state_home,
)
from meshlearn.network.channel.probes import fetch_key_line, refusal
from meshlearn.network.channel.rpc import call, parse_address

PROBE_TIMEOUT = 3.0  # seconds to wait for a TCP connection to a bootstrap's port, to learn whether anything runs there


class KnownBootstraps:
    """A file of ``HOST:PORT KEY`` lines: the bootstraps this machine has trusted."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path).expanduser() if path else state_home() / "known_bootstraps"

    def get(self, address: str) -> bytes | None:
        if not self.path.is_file():
            return None
        for line in self.path.read_text().splitlines():
            words = line.split()
            if len(words) == 2 and words[0] == address:
                try:
                    return key_from_text(words[1])
                except UserInputError:
                    raise UserInputError(f"{self.path}: the line for {address} holds no valid key: remove it") from None
        return None

    def remember(self, address: str, key: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path, "a") as f:
            f.write(f"{address} {key_text(key)}\n")


def resolve_bootstrap(text: str, secret: bytes, known: KnownBootstraps, say: Callable[[str], None],
                      check: bool = True, required: bool = False) -> str:
    """``HOST:PORT@KEY`` of the bootstrap given as ``text``: its pinned key, else the one recorded
    for it, else (first use) the key it announces, recorded with a warning once the bootstrap
    proved it. With ``check``, the bootstrap is asked once: a different key is refused with what
    to do; one not running is left for the caller's retries, or (``required``: a requester, which
    has nothing to wait for) said at once."""
    plain, key = split_pinned(text)
    address = parse_address(plain, "--bootstrap")
    origin, first_use = "--bootstrap", False
    if key is None:
        key, origin = known.get(address), str(known.path)
    if key is None:
        key, first_use = _announced_key(address), True
    where = pinned(address, key)
    if check or first_use:
        try:
            call(where, "ping", {}, secret, timeout=5)
        except KeyMismatch:
            fix = (f"remove the line for {address} from {origin} if its key was changed on purpose"
                   if origin != "--bootstrap" else "check the key you pinned")
            raise UserInputError(f"the bootstrap at {address} does not prove the key {key_text(key)} "
                                 f"{'it announced' if first_use else f'recorded for it ({origin})'}: refusing it "
                                 f"(someone may pose as it); {fix if not first_use else 'pin the key it printed'}"
                                 ) from None
        except KeyRefused as exc:
            raise UserInputError(f"cannot use the bootstrap at {address}: {exc}") from None
        except AuthError:
            raise UserInputError(f"cannot use the bootstrap at {address}: it uses a different secret; give this "
                                 "machine the network's --secret, --secret-file or MESHLEARN_SECRET") from None
        except NetworkError:
            if required:
                raise nothing_answers(address) from None
            if first_use:  # nothing proved: use the key this once, record nothing
                say(f"warning: using the key the bootstrap at {address} announced, {key_text(key)}, unchecked (it did "
                    f"not answer); pin it: --bootstrap {address}@KEY")
                return where
    if first_use:
        known.remember(address, key)
        say(f"warning: trusting the bootstrap at {address} on first use: key {key_text(key)} ({fingerprint(key)}); "
            f"recorded in {known.path}. Compare it with what the bootstrap printed, or pin it: --bootstrap "
            f"{address}@{key_text(key)}")
    return where


class NothingAnswers(UserInputError):
    """No bootstrap answers at an address (not running, or a wrong address)."""


def resolve_bootstraps(text: str, secret: bytes, known: KnownBootstraps, say: Callable[[str], None],
                       check: bool = True, required: bool = False) -> str:
    """``--bootstrap`` resolved: one bootstrap as ``resolve_bootstrap`` does, or several
    (comma-separated, a network whose bootstraps share one registry), each the same way, except
    that one not answering now is kept where its key is pinned or recorded (the others answer for
    it meanwhile) and left out, with a warning, where it is not. ``required``: at least one must
    answer. Returns the pinned addresses, comma-separated."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if len(parts) <= 1:
        return resolve_bootstrap(text, secret, known, say, check, required)
    resolved, answered = [], False
    for part in parts:
        try:
            resolved.append(resolve_bootstrap(part, secret, known, say, check, required=True))
            answered = True
        except NothingAnswers:
            plain, key = split_pinned(part)
            address = parse_address(plain, "--bootstrap")
            key = key if key is not None else known.get(address)
            if key is None:
                say(f"warning: left out the bootstrap at {address}: it does not answer, and its key is neither "
                    "pinned nor recorded")
                continue
            resolved.append(pinned(address, key))
    if not resolved or (required and not answered):
        raise NothingAnswers(f"no bootstrap answers at any of {', '.join(parts)}: are they running? Start one, or "
                             "correct --bootstrap")
    return ",".join(resolved)


def nothing_answers(address: str, why: str = "") -> UserInputError:
    """The one line for a bootstrap address where nothing answers (``why``: what was seen there):
    it is not running, or the address is wrong; a key would not help."""
    return NothingAnswers(f"no bootstrap answers at {address}{f' ({why})' if why else ''}: is it running, on this "
                          "host and port? Start it, or correct --bootstrap")


def _announced_key(address: str) -> bytes:
    """The key the bootstrap's relay port (its port + 1) announces, unauthenticated. Where none is
    learnt, the one line says why: nothing runs at ``address`` (a key would not help), or something
    does but announces no key on the relay port (then the key must be given)."""
    host, _, port = address.rpartition(":")
    relay = f"{host}:{int(port) + 1}"
    try:
        return key_from_text(fetch_key_line(relay), "the key the bootstrap announced")
    except Unreachable as exc:
        down = refusal(address, PROBE_TIMEOUT)
        if down is not None:
            raise nothing_answers(address, down) from None
        why = f"something answers there, but its relay port does not: {exc}"
    except (NetworkError, UserInputError) as exc:
        why = str(exc)
    raise UserInputError(f"cannot learn the key of the bootstrap at {address} ({why}): give it with "
                         f"--bootstrap {address}@KEY (the key the bootstrap printed at start; trust on first "
                         "use needs its relay on the default port, --port + 1)")
