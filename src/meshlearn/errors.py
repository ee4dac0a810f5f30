"""The error types meshlearn raises, in one hierarchy; the CLI turns each into one line and an exit code.

    MeshlearnError (exit 1)
    ├── UserInputError (exit 2): ConfigError, TopologyError, DatasetError, ModelError, PortInUseError
    ├── WireError, TransportError
    ├── NetworkError: AuthError, BadMessage, RemoteError, Unreachable, TaskFailed
    ├── TaskCancelled
    └── NodeFailure

A UserInputError about one setting carries its name and the value given (``setting``, ``value``), so
the command line can name the flag as it was typed (``--partition shards:abc: K must be ...``): the
one place that writes that prefix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class MeshlearnError(Exception):
    """Base of every error meshlearn raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UserInputError(MeshlearnError):
    """Bad input from the user (flag, config file, path): exit code 2.

    ``problem``: what is wrong. Where it is about one setting, ``setting`` names it (as a file, or a
    flag's destination, writes it) and ``value`` is what was given: the error reads ``setting 'value':
    problem``, and the command line writes ``--setting value: problem``."""

    exit_code = 2

    def __init__(self, problem: str = "", setting: str | None = None, value: Any = None):
        shown = "" if value is None or isinstance(value, (dict, list)) else f" {value!r}"
        super().__init__(f"{setting}{shown}: {problem}" if setting else problem)
        self.problem, self.setting, self.value = problem, setting, value


@contextlib.contextmanager
def about(setting: str, value: Any) -> Iterator[None]:
    """Name ``setting`` and its ``value`` in a UserInputError raised inside that names no setting of
    its own (a check that knows what is wrong with a value, not which setting it came from), for the
    command line to name the flag; its message stays as it was."""
    try:
        yield
    except UserInputError as exc:
        if not exc.setting:
            exc.setting, exc.value = setting, value
        raise


class ConfigError(UserInputError):
    """An invalid configuration value or file."""


class TopologyError(UserInputError):
    """An invalid topology: bad spec, unreadable graph file, or a disconnected graph."""


class DatasetError(UserInputError):
    """A dataset or partition that cannot be loaded or made as asked."""


class ModelError(UserInputError):
    """An unknown model name or a model that does not fit the data."""


class CheckpointError(UserInputError):
    """A checkpoint that cannot be resumed from: missing, damaged, or of another run."""


class WireError(MeshlearnError):
    """A message that cannot be decoded: bad magic/version, wrong sizes, unknown dtype, too big."""


class TransportError(MeshlearnError):
    """A transport failure: a port in use, a neighbour that never answered the handshake."""


class ThreadFailed(TransportError):
    """A background thread a node depends on (serving, receiving, watching) died of an exception."""


class PortInUseError(UserInputError):
    """A port the user asked for is taken by another process."""


class NetworkError(MeshlearnError):
    """A network-service failure: an unreachable peer, a refused request, a bad message."""


class AuthError(NetworkError):
    """A message that is not signed with this network's secret, or a key refused."""


class KeyMismatch(AuthError):
    """The service at an address does not prove the key it was pinned to (another one, or a man in the middle)."""


class KeyRefused(AuthError):
    """A service refused this participant's key (revoked, or not admitted)."""


class BadMessage(NetworkError):
    """A message that is malformed, too big, or of an unknown version or kind."""


class RemoteError(NetworkError):
    """The peer understood the request and refused it; the message says why."""


class ProtocolMismatch(NetworkError):
    """The peer speaks another version of the network's protocol: one of the two must upgrade."""


class Unreachable(NetworkError):
    """No reply from the peer before the deadline."""


class ServiceUnavailable(RemoteError):
    """The service answered that it cannot serve now (a bootstrap whose shared registry has no
    majority behind it): another one of its kind may."""


class TaskFailed(NetworkError):
    """A task could not finish: every provider failed or vanished."""


class TaskCancelled(MeshlearnError):
    """Raised inside a provider's task run when its requester cancels it (or the provider stops)."""


class NodeFailure(MeshlearnError):
    """A simulated node process failed or died; the message names it and says why."""
