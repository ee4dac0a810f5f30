"""Switches for tests only, never set in use: a provider that forges bad models, emulates a slow
network on its task engines' links, or declares a device it does not train on.

They are read from the environment once, where a provider process is built
(``TestHooks.from_environment``, called by ``meshlearn provider``), and the object is passed down;
production code asks it, never the environment. Tests set the variables on the provider processes
they start. Default: no hooks (``NO_HOOKS``), as for a provider built in a test's own process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from meshlearn.attacks.spec import parse_byzantine
from meshlearn.errors import UserInputError
from meshlearn.netem import NetemSpec

# A byzantine behaviour (``BEHAVIOUR[:ARG]``, e.g. ``sign-flip:10``) every model the provider sends
# gets: for tests of robust aggregation.
POISON_ENV = "MESHLEARN_TEST_POISON"
# ``--net``'s syntax (e.g. ``loss=20%,delay=200ms,jitter=50ms``): the emulated network on the links of
# the provider's task engines, for tests and benchmarks of slow, lossy links on one machine.
NET_ENV = "MESHLEARN_TEST_NET"
# The device the provider declares to the bootstrap, whatever it trains on: for tests of device selection.
DEVICE_ENV = "MESHLEARN_TEST_DEVICE"
DECLARABLE_DEVICES = ("cpu", "cuda", "mps")


@dataclass(frozen=True)
class TestHooks:
    """What a provider does differently in a test (see the module docstring): read once at the
    edge, asked by the provider and its task runs. A bad value is refused as the object is made."""

    __test__: ClassVar[bool] = False  # pytest: a class named Test..., not a test case

    model_poison: str = ""  # a byzantine behaviour forged into every model sent ("": none)
    engine_net: NetemSpec | None = None  # the emulated network on task engines' links (None: the real one)
    declared_device: str = ""  # the device declared to the bootstrap ("": the one it trains on)

    def __post_init__(self) -> None:
        if not isinstance(self.model_poison, str) or not isinstance(self.declared_device, str):
            raise UserInputError("test hooks: model_poison and declared_device are text")
        if self.engine_net is not None and not isinstance(self.engine_net, NetemSpec):
            raise UserInputError("test hooks: engine_net is a NetemSpec or None")
        if self.model_poison:
            _check_poison(self.model_poison)
        if self.declared_device not in ("", *DECLARABLE_DEVICES):
            raise UserInputError(f"not one of {', '.join(DECLARABLE_DEVICES)}", setting="declared_device",
                                 value=self.declared_device)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> TestHooks:
        """The hooks ``MESHLEARN_TEST_POISON``, ``MESHLEARN_TEST_NET`` and ``MESHLEARN_TEST_DEVICE``
        set (in ``environ``, by default this process's environment); a bad value is one
        UserInputError naming its variable."""
        env = os.environ if environ is None else environ
        poison, net, device = (env.get(name, "").strip() for name in (POISON_ENV, NET_ENV, DEVICE_ENV))
        with _naming(POISON_ENV, poison):
            cls(model_poison=poison)
        with _naming(NET_ENV, net):
            engine_net = NetemSpec.parse(net) if net else None
        with _naming(DEVICE_ENV, device):
            cls(declared_device=device)
        return cls(poison, engine_net, device)


NO_HOOKS = TestHooks()


def _check_poison(behaviour: str) -> None:
    """Refuse what is not one byzantine behaviour (``BEHAVIOUR[:ARG]``: this provider is its rank)."""
    try:
        parse_byzantine(f"0:{behaviour}")
    except UserInputError as exc:
        raise UserInputError(f"{exc.problem}; here BEHAVIOUR[:ARG] without the rank, e.g. sign-flip:10",
                             setting="model_poison", value=behaviour) from None


@contextlib.contextmanager
def _naming(variable: str, value: str) -> Iterator[None]:
    """A refusal of ``value`` as one line naming the environment variable it came from."""
    try:
        yield
    except UserInputError as exc:
        raise UserInputError(f"{variable}={value!r} is refused: {exc.problem} (a switch for tests only: fix or "
                             "unset it)") from None
