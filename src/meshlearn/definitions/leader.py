"""Leader aggregation's declaration (CloudMesh). Its runtimes drive one leader's book,
``definitions.leaderstate.LeaderState``, and one member's decisions, ``definitions.leadermember.LeaderMember``:
``node.algorithms.leader`` (process engine) and ``batched.algorithms.leader``."""

from meshlearn.definitions.base import Definition, register_algorithm
from meshlearn.definitions.needs import Needs
from meshlearn.definitions.settings import LeaderSettings


@register_algorithm
class LeaderDefinition(Definition):
    """An elected member aggregates everyone's latest model and answers each push."""

    name = "leader"
    summary = "asynchronous leader aggregation, as CloudMesh"
    needs = Needs(endpoint="hub", synchronous=False, robust=True, byzantine=True, network=True, outer=True)
    settings = LeaderSettings

    @classmethod
    def conflict(cls, run) -> str | None:
        """An outer optimizer needs synchronous cycles: the asynchronous leader answers each push at
        once, with no aggregate every member takes and an outer step could follow."""
        if run.outer.active and not run.leader.sync:
            return (f"outer {run.outer.spec} with the leader needs aggregations every member takes at once: add "
                    "leader_sync true (synchronous cycles), or use outer none")
        return None
