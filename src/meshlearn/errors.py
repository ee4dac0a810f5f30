"""The error types meshlearn raises; the CLI turns each into one line and an exit code."""


class MeshlearnError(Exception):
    """Base of every error meshlearn raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UserInputError(MeshlearnError):
    """Bad input from the user (flag, config file, path): exit code 2."""

    exit_code = 2


class ConfigError(UserInputError):
    """An invalid configuration value or file."""


class TopologyError(UserInputError):
    """An invalid topology: bad spec, unreadable graph file, or a disconnected graph."""


class DatasetError(UserInputError):
    """A dataset or partition that cannot be loaded or made as asked."""


class ModelError(UserInputError):
    """An unknown model name or a model that does not fit the data."""


class WireError(MeshlearnError):
    """A message that cannot be decoded: bad magic/version, wrong sizes, unknown dtype, too big."""


class TransportError(MeshlearnError):
    """A transport failure: a port in use, a neighbour that never answered the handshake."""


class PortInUseError(UserInputError):
    """A port the user asked for is taken by another process."""
