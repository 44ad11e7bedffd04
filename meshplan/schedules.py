"""Pipeline schedules: the one list of names the plan file, the planner, the cost model and
the runtime share.

trace -> cost -> solve -> **plan** -> run. ``gpipe`` runs every forward, then every
backward (Huang et al. 2019); ``1f1b`` alternates them once the pipeline is full, which
keeps at most ``pp`` microbatches in flight (Narayanan et al. 2021, PipeDream-Flush);
``interleaved-1f1b`` gives each rank ``virtual_stages`` chunks of layers (Narayanan et al.
2021, section 2.2). The runtime maps each name to a ``torch.distributed.pipelining``
schedule class (``runtime/graph/pipeline.py``: ``TORCH_SCHEDULES``).

A ``Schedule`` is a ``StrEnum`` (``vocabulary.PlanName``): a member equals its plan-file
string (``Schedule.GPIPE == "gpipe"``), so plan records keep plain strings and compare
against members.
"""

from __future__ import annotations

from meshplan.errors import PlanningError
from meshplan.vocabulary import PlanName


class Schedule(PlanName):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """"1f1b" -> Schedule.ONE_F_ONE_B; an unknown name is refused in one line."""
        try:
            return cls(text)
        except ValueError:
            raise PlanningError(f"schedule={text!r}; choose one of "
                                f"{', '.join(SCHEDULES)}") from None


SCHEDULES = tuple(s.value for s in Schedule)  # ("gpipe", "1f1b", "interleaved-1f1b")


def virtual_stages_for(schedule: str, virtual_stages: int) -> int:
    """Model chunks per pipeline rank: ``virtual_stages`` under the interleaved schedule, 1
    under every other (a plan may carry virtual_stages > 1 that only interleaving uses)."""
    return virtual_stages if schedule == Schedule.INTERLEAVED else 1
