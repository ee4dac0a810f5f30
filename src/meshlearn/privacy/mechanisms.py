"""The built-in privacy mechanisms (``privacy.mechanism``): DP-SGD in each node's local steps (the
``dp`` setting), secure aggregation of the leader's cycles (``secure_aggregation``) and central DP
of its aggregate (``central_dp``). Their settings stay where users write them; each mechanism reads
its own. What they compute with is imported inside their hooks: this module loads without torch,
so that a configuration is checked against them before torch loads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshlearn.privacy.mechanism import (
    Conflicts,
    PrivacyMechanism,
    PrivateNodes,
    register_privacy,
)

LEADER_CYCLES = "algorithm leader with leader_sync true (FedAvg whose server fails over: leader_fraction F)"
MIN_SECURE = 3  # members a secure cycle needs: with fewer, the leader (a member) learns another's model


@register_privacy
class DPSGD(PrivacyMechanism):
    """DP-SGD (``privacy.dpsgd``): each node's gradient is the sum of its examples' gradients clipped
    to ``max_grad_norm``, plus Gaussian noise from the node's own generator, over the batch; each
    node's accountant (``privacy.budget``) says the epsilon its steps spent."""

    name = "dp-sgd"
    summary = "differential privacy of each node's training (the dp setting)"
    asked = ("dp", "dp none")
    flag = ("--dp", "--dp")

    @classmethod
    def active(cls, settings: Any) -> bool:
        return settings.dp.active

    @classmethod
    def secret_batches(cls, settings: Any) -> bool:
        return not settings.dp.seeded

    def __init__(self, config: Any, nodes: PrivateNodes):
        from meshlearn.privacy.budget import PrivacyBudget
        from meshlearn.privacy.dpsgd import noise_generator

        super().__init__(config, nodes)
        self.settings, total = config.dp, config.iterations * nodes.steps
        self.budgets = [PrivacyBudget.of(config.dp, config.batch_size, size, total) for size in nodes.samples]
        self.generators = [noise_generator(config.seed, rank, nodes.device, seeded=config.dp.seeded)
                           for rank in nodes.ranks]
        self.steps = [0] * len(nodes.ranks)  # each node's steps taken (its epsilon counts them)

    def clip_norm(self) -> float | None:
        return self.settings.max_grad_norm

    def local_step(self, rows: Sequence[int], grads) -> None:
        """Each node's clipped sum noised and over the batch (``privacy.dpsgd.noisy_mean``)."""
        from meshlearn.privacy.dpsgd import noisy_mean

        for k, row in enumerate(rows):
            noisy_mean(grads[k], self.budgets[row].noise_multiplier, self.settings.max_grad_norm,
                       self.config.batch_size, self.generators[row])
            self.steps[row] += 1

    def resumed(self, done: int) -> None:
        self.steps = [done * self.nodes.steps] * len(self.steps)

    def progress(self, row: int, done: int) -> dict[str, Any]:
        return {"epsilon": self.budgets[row].epsilon(done * self.nodes.steps)}

    def report(self, row: int) -> dict[str, Any]:
        return {"privacy": self.budgets[row].report(self.steps[row])}

    def group_report(self, samples: Sequence[int]) -> dict[str, Any]:
        """The epsilon each provider spent (from its shard's size and this node's steps), summed up
        as a simulation's summary says it."""
        from meshlearn.privacy.budget import PrivacyBudget, privacy_summary

        own, steps = self.budgets[0], self.steps[0]
        reports = [PrivacyBudget.of(self.settings, self.config.batch_size, size, own.total_steps).report(steps)
                   for size in samples if size]
        return {"privacy": privacy_summary(reports or [own.report(steps)])}


@register_privacy
class SecureAggregation(PrivacyMechanism):
    """Secure aggregation (``privacy.secagg``) of the synchronous leader's cycles: each member masks
    its contribution (``masked_push``), so the leader learns only the cycle's sum. The leader
    carries the session (``node.algorithms.secure``)."""

    name = "secure-aggregation"
    summary = "the leader learns only each cycle's weighted sum (the secure_aggregation setting)"
    asked = ("secure_aggregation true", "secure_aggregation false")
    flag = ("--secure-aggregation true", "--secure-aggregation")

    @classmethod
    def active(cls, settings: Any) -> bool:
        return settings.leader.secure

    @classmethod
    def conflicts(cls, config: Any) -> Conflicts:
        return [(config.algorithm != "leader", LEADER_CYCLES),
                (not config.leader.sync, "leader_sync true (masks cancel only in the sum of one cycle's models)"),
                (config.engine != "process", "engine process (members agree on masks between real processes)"),
                (config.nodes < MIN_SECURE, "at least 3 nodes (with 2, the leader would learn the other's model)"),
                (config.leader.drawn(config.nodes) < MIN_SECURE, (f"leader_fraction drawing at least 3 of the "
                 f"{config.nodes} nodes (fewer, and the leader would learn another's model from the sum)")),
                *_each_model(config.aggregation, bool(config.byzantine))]

    @classmethod
    def task_conflicts(cls, task: Any, providers: int, joins: bool) -> Conflicts:
        drawing = task.fedavg if task.algorithm == "fedavg" else task.leader
        return [(task.algorithm not in ("leader", "fedavg"), f"algorithm fedavg or leader (not {task.algorithm})"),
                (task.algorithm == "leader" and not task.leader.sync, ("--leader-sync true (masks cancel only in "
                 "the sum of one cycle's models)")),
                (providers < MIN_SECURE, "at least 3 providers (with 2, the leader would learn the other's model)"),
                (drawing.drawn(providers) < MIN_SECURE, ("a fraction drawing at least 3 providers each cycle "
                 "(fewer, and the leader would learn another's model)")),
                (joins, ("every provider from the start (a newcomer has no share of the members' keys): leave "
                 "--min-providers out")),
                *_each_model(task.aggregation, False)]

    def masked_push(self, member: Any, cycle: int, contribution: Any, members: list[int],
                    publics: dict[int, bytes]) -> Any:
        """``contribution`` masked for the sum of ``cycle``'s ``members`` (``SecureMember.mask``)."""
        return member.mask(cycle, contribution, members, publics)


def _each_model(aggregation: str, byzantine: bool) -> Conflicts:
    """What secure aggregation cannot go with: rules and attacks that need each model."""
    return [(aggregation != "mean", (f"aggregation mean ({aggregation} needs each member's model, which secure "
             "aggregation hides from the leader)")),
            (byzantine, "no byzantine nodes (attacks forge and watch individual models)")]


@register_privacy
class CentralDP(PrivacyMechanism):
    """Central DP of the leader's aggregate (``privacy.central``, DP-FedAvg): each member clips its
    update over a cycle before its push, the leader noises each cycle's aggregate, and each member
    counts the aggregates it took (its epsilon)."""

    name = "central-dp"
    summary = "noise on the leader's aggregate of clipped updates (the central_dp setting)"
    asked = ("central_dp", "central_dp none")
    flag = ("--central-dp", "--central-dp")

    @classmethod
    def active(cls, settings: Any) -> bool:
        return settings.leader.central_dp.active

    @classmethod
    def conflicts(cls, config: Any) -> Conflicts:
        return [(config.algorithm != "leader", LEADER_CYCLES),
                (not config.leader.sync, "leader_sync true (every member clips its update over one cycle)"),
                (config.leader.weighting != "equal", ("leader_weighting equal (the noise is sized to one "
                 "member's clipped update, which counts the same as every other)")),
                (config.engine != "process", "engine process"),
                (config.aggregation != "mean", "aggregation mean")]

    @classmethod
    def task_conflicts(cls, task: Any, providers: int, joins: bool) -> Conflicts:
        leader = task.leader
        return [(task.algorithm not in ("leader", "fedavg") or (task.algorithm == "leader" and (
            not leader.sync or leader.weighting != "equal")) or task.aggregation != "mean",
                 ("algorithm fedavg, or leader with --leader-sync true and --leader-weighting equal, and "
                  "--aggregation mean"))]

    def __init__(self, config: Any, nodes: PrivateNodes):
        from meshlearn.privacy.central import leader_generator

        super().__init__(config, nodes)
        self.settings, self.fraction = config.leader.central_dp, config.leader.fraction
        self.generator = leader_generator(config.seed, self.settings.seeded)  # the noise of the cycles it leads
        self.start = None  # the model this member's cycle started from
        self.cycles = 0  # the aggregates this member took

    def begin(self, state) -> None:
        self.start = state.to("cpu", copy=True)

    def before_push(self, state) -> None:
        """This member's update over the cycle clipped."""
        from meshlearn.privacy.central import clip_update

        clip_update(state, self.start, self.nodes.params, self.settings.clip)

    def aggregate_noise(self, aggregate, count: int):
        from meshlearn.privacy.central import noised

        return noised(aggregate, self.nodes.params, self.settings.noise_multiplier, self.settings.clip, count,
                      self.generator)

    def after_aggregate(self, aggregate) -> None:
        """The next update counts from ``aggregate``."""
        self.start.copy_(aggregate)
        self.cycles += 1

    def report(self, row: int) -> dict[str, Any]:
        """The epsilon this member spent over the cycles it took (the fraction's draws)."""
        from meshlearn.privacy.central import central_report

        central = self.settings
        return {"central_privacy": central_report(central.noise_multiplier, central.clip, central.delta,
                                                  self.fraction, self.cycles)}
