"""Privacy mechanisms as extensions: each one a ``PrivacyMechanism`` that declares when it acts
(``active``), what it cannot run with (``conflicts`` for a run's configuration, ``task_conflicts``
for a network task) and its hooks, each with a default that does nothing. ``PRIVACY_MECHANISMS``
holds them by name: DP-SGD (``dp-sgd``), secure aggregation (``secure-aggregation``) and central DP
(``central-dp``) are built in (``privacy.mechanisms``); a ``--models-module`` file registers its own
with ``register_privacy``.

The engines build one ``Privacy`` for the nodes they compute (a process-engine node, a batched
block), from the mechanisms its configuration makes active, and call each hook through it in one
place: the local step (``local_step``, after the engine's gradient, per-example clipped where a
mechanism asks it with ``clip_norm``), a leader member's push (``before_push``, ``masked_push``,
``after_aggregate``), the leader's aggregate (``aggregate_noise``), and what is logged
(``progress``, ``report``, ``group_report``).

No torch at import: a configuration is checked against the mechanisms before torch loads (the
built-in ones import what they compute with inside their hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from meshlearn.errors import ConfigError
from meshlearn.plugins import Registry

if TYPE_CHECKING:
    from torch import Tensor

Conflicts = list[tuple[bool, str]]  # (whether the run lacks it, what the mechanism needs)
BUILT_IN = ("dp-sgd", "secure-aggregation", "central-dp")  # in the order their hooks and checks run


@dataclass(frozen=True)
class PrivateNodes:
    """The nodes one ``Privacy`` serves, as rows: their ``ranks``, the training examples of each
    (``samples``), the local steps of an iteration (``steps``), the ``device`` their tensors live on
    and the parameters at the head of their flat state (``params``; buffers follow them)."""

    ranks: tuple[int, ...]
    samples: tuple[int, ...]
    steps: int = 1
    device: str = "cpu"
    params: int = 0


class PrivacyMechanism:
    """A privacy mechanism: its declarations (class methods, read where a configuration is checked,
    no torch) and its hooks (an instance per ``PrivateNodes``, built with the run's ``config``).
    Every hook has a default that does nothing; a mechanism overrides those it needs. ``asked`` and
    ``flag`` name how a run and a network task ask for it, and what does without it, for the
    refusals ``conflicts`` and ``task_conflicts`` lead to."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    asked: ClassVar[tuple[str, str]] = ("", "")  # a run's setting that asks for it, the setting without it
    flag: ClassVar[tuple[str, str]] = ("", "")  # a network task's flag that asks for it, the flag to leave out

    # --- declarations ----------------------------------------------------------------------------

    @classmethod
    def active(cls, settings: Any) -> bool:
        """Whether a run (an ``ExperimentConfig``) or a network task (its request or spec) with
        ``settings`` uses this mechanism: by default, where its ``privacy`` setting names it (a
        mechanism a module registers); the built-in ones read their own settings."""
        return cls.name in getattr(settings, "privacy", ())

    @classmethod
    def conflicts(cls, config: Any) -> Conflicts:
        """What this mechanism needs that a run may lack, where it is active: (lacking, need) pairs."""
        return []

    @classmethod
    def task_conflicts(cls, task: Any, providers: int, joins: bool) -> Conflicts:
        """As ``conflicts``, for a network task of ``providers`` providers (``joins``: more may join
        as it runs)."""
        return []

    @classmethod
    def secret_batches(cls, settings: Any) -> bool:
        """Whether, where active, each node's batches must come from secret randomness (DP-SGD's
        sampling), not from the run's seed."""
        return False

    # --- hooks -----------------------------------------------------------------------------------

    def __init__(self, config: Any, nodes: PrivateNodes):
        self.config, self.nodes = config, nodes

    def clip_norm(self) -> float | None:
        """The norm each example's gradient is clipped to before the batch's are summed (the engines
        then give ``local_step`` that sum, not the mean gradient); None: the plain mean gradient."""
        return None

    def local_step(self, rows: Sequence[int], grads: Tensor) -> None:
        """In place, before the optimizer's step: the gradients ``grads`` [n, P] of the nodes at
        ``rows`` (of ``nodes``, in that order)."""

    def begin(self, state: Tensor) -> None:
        """A leader member's first model ``state`` (flat), before its first cycle."""

    def before_push(self, state: Tensor) -> None:
        """In place: the flat model a leader member pushes (a copy of its own)."""

    def masked_push(self, member: Any, cycle: int, contribution: Any, members: list[int],
                    publics: dict[int, bytes]) -> Any:
        """What a leader member (``member``: its ``privacy.secagg.SecureMember``) sends for ``cycle``
        in place of its ``contribution`` (its weighted model, then the weight) among ``members``
        with their public keys ``publics``; None: the plain exchange, the model as it is."""
        return None

    def aggregate_noise(self, aggregate: Tensor, count: int) -> Tensor:
        """The leader's aggregate of ``count`` models as it is sent back (a new tensor where changed)."""
        return aggregate

    def after_aggregate(self, aggregate: Tensor) -> None:
        """A leader member took ``aggregate`` (its new model)."""

    def resumed(self, done: int) -> None:
        """The run resumed after ``done`` iterations (its steps before count)."""

    def progress(self, row: int, done: int) -> dict[str, Any]:
        """Fields of the node at ``row``'s evaluation event after ``done`` iterations."""
        return {}

    def report(self, row: int) -> dict[str, Any]:
        """Fields of the node at ``row``'s final event (what it spent)."""
        return {}

    def group_report(self, samples: Sequence[int]) -> dict[str, Any]:
        """What a network task's result says for its providers of ``samples`` examples each: this
        node's ``report`` by default."""
        return self.report(0)


PRIVACY_MECHANISMS: Registry[type[PrivacyMechanism]] = Registry(
    "privacy mechanism", built_in=dict.fromkeys(BUILT_IN, "meshlearn.privacy.mechanisms"))


def register_privacy(cls: type[PrivacyMechanism]) -> type[PrivacyMechanism]:
    """Class decorator adding a privacy mechanism under ``cls.name``: every engine calls its hooks
    in the runs it is ``active`` in, and the configuration checks its ``conflicts``."""
    return PRIVACY_MECHANISMS.add(cls.name, cls)


def active_mechanisms(settings: Any, loaded: bool = True) -> list[type[PrivacyMechanism]]:
    """The registered mechanisms ``settings`` (a run's or a network task's) makes active: the
    built-in ones first, then those a module registered, by name. ``loaded``: the run's module has
    loaded, so a name its ``privacy`` setting gives that nothing registered is refused (ConfigError);
    else (a configuration being checked before its module loads) it is left for then."""
    unknown = [name for name in getattr(settings, "privacy", ()) if name not in PRIVACY_MECHANISMS]
    if unknown and loaded:
        raise ConfigError(f"{PRIVACY_MECHANISMS.unknown(unknown[0])}, or register yours in the --models-module file "
                          "the run names", setting="privacy", value=unknown[0])
    names = [*BUILT_IN, *PRIVACY_MECHANISMS.extensions()]
    return [mechanism for mechanism in map(PRIVACY_MECHANISMS.get, names) if mechanism.active(settings)]


def secret_batches(settings: Any) -> bool:
    """Whether a run's batches must come from secret randomness (an active mechanism says so)."""
    return any(mechanism.secret_batches(settings) for mechanism in active_mechanisms(settings))


def overrides(mechanism: PrivacyMechanism, hook: str) -> bool:
    """Whether ``mechanism`` has a ``hook`` of its own (not the default that does nothing)."""
    return getattr(type(mechanism), hook) is not getattr(PrivacyMechanism, hook)


class Privacy:
    """The active mechanisms of the nodes an engine computes, and each hook called for all of them
    (in ``active_mechanisms``' order): the one place an engine calls them. ``Privacy()`` has none."""

    def __init__(self, mechanisms: Sequence[PrivacyMechanism] = ()):
        self.mechanisms = list(mechanisms)
        self._stepping = [m for m in self.mechanisms if overrides(m, "local_step")]
        self._noising = [m for m in self.mechanisms if overrides(m, "aggregate_noise")]
        self._masking = next((m for m in self.mechanisms if overrides(m, "masked_push")), None)
        self.clip_norm = next((norm for m in self.mechanisms if (norm := m.clip_norm()) is not None), None)

    @classmethod
    def of(cls, config: Any, nodes: PrivateNodes) -> Privacy:
        """The mechanisms ``config`` makes active, built for ``nodes``."""
        return cls([mechanism(config, nodes) for mechanism in active_mechanisms(config)])

    @property
    def changes_steps(self) -> bool:
        """Whether a local step is not the plain one: a mechanism clips per example or changes the gradient."""
        return self.clip_norm is not None or bool(self._stepping)

    def local_step(self, rows: Sequence[int] | Tensor, grads: Tensor | None) -> None:
        """``PrivacyMechanism.local_step`` of each mechanism (``grads`` None: a step fused with the
        optimizer's, which the engines take only where no mechanism ``changes_steps``)."""
        if self._stepping and grads is not None:
            rows = rows.tolist() if hasattr(rows, "tolist") else list(rows)
            for mechanism in self._stepping:
                mechanism.local_step(rows, grads)

    @property
    def masks(self) -> bool:
        """Whether a leader member's pushes are masked (``masked_push``): the leader's secure exchange."""
        return self._masking is not None

    def masked_push(self, member: Any, cycle: int, contribution: Any, members: list[int],
                    publics: dict[int, bytes]) -> Any:
        """The masking mechanism's ``masked_push``."""
        return self._masking.masked_push(member, cycle, contribution, members, publics)

    def begin(self, state: Tensor) -> None:
        """Each mechanism's ``begin``."""
        for mechanism in self.mechanisms:
            mechanism.begin(state)

    def before_push(self, state: Tensor) -> None:
        """Each mechanism's ``before_push``, in place."""
        for mechanism in self.mechanisms:
            mechanism.before_push(state)

    @property
    def noise(self) -> Callable[[Tensor, int], Tensor] | None:
        """The aggregate's noise, every ``aggregate_noise`` in turn; None where no mechanism adds any."""
        if not self._noising:
            return None

        def noised(aggregate: Tensor, count: int) -> Tensor:
            for mechanism in self._noising:
                aggregate = mechanism.aggregate_noise(aggregate, count)
            return aggregate

        return noised

    def after_aggregate(self, aggregate: Tensor) -> None:
        """Each mechanism's ``after_aggregate``."""
        for mechanism in self.mechanisms:
            mechanism.after_aggregate(aggregate)

    def resumed(self, done: int) -> None:
        """Each mechanism's ``resumed``."""
        for mechanism in self.mechanisms:
            mechanism.resumed(done)

    def progress(self, row: int, done: int) -> dict[str, Any]:
        """Every mechanism's ``progress`` fields."""
        return {key: value for mechanism in self.mechanisms for key, value in mechanism.progress(row, done).items()}

    def report(self, row: int) -> dict[str, Any]:
        """Every mechanism's ``report`` fields."""
        return {key: value for mechanism in self.mechanisms for key, value in mechanism.report(row).items()}

    def group_report(self, samples: Sequence[int]) -> dict[str, Any]:
        """Every mechanism's ``group_report`` fields."""
        return {key: value for mechanism in self.mechanisms for key, value in mechanism.group_report(samples).items()}
