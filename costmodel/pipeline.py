"""Pipeline schedules: step time from per-microbatch stage times, bubble, in-flight work.

trace -> **cost** -> solve -> run. Used by estimate.py for every plan and by the pipeline
planner for its candidates. With p stages of per-microbatch times t_i (forward + backward
+ recompute + exposed communication of one microbatch), m microbatches and v virtual
stages per device (interleaved 1F1B):

    step = m * max(t) + (sum(t) - max(t)) / v

For equal stages this is (m + (p - 1) / v) * t: the bubble fraction (p - 1) / (v m) of
Narayanan et al. 2021 (section 2.2, eq. 1 and the interleaved schedule), and for v = 1 it
is Alpa's latency sum(t) + (m - 1) * max(t) (Zheng et al. 2022, eq. 2). GPipe and 1F1B have
the same bubble; they differ in memory (memory.inflight_microbatches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.errors import PlanningError
from meshplan.plan import SCHEDULES


@dataclass(frozen=True, slots=True)
class PipelineTime:
    step_s: float  # time of the pipelined forward/backward of all microbatches
    busy_s: float  # m x mean stage time: the work of the average stage
    bubble_s: float  # step_s - m x max stage time (idle time of the bottleneck stage)

    @property
    def bubble_fraction(self) -> float:
        return (self.step_s - self.busy_s) / self.step_s if self.step_s else 0.0


def pipeline_step_time(stage_times: Sequence[float], microbatches: int, schedule: str = "1f1b",
                       virtual_stages: int = 1) -> PipelineTime:
    """Step time of the pipelined part of a training step (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise PlanningError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if microbatches < 1 or not stage_times:
        raise PlanningError(f"microbatches={microbatches} and {len(stage_times)} stages: need "
                            "at least one of each")
    v = virtual_stages if schedule == "interleaved-1f1b" else 1
    t_max = max(stage_times)
    step = microbatches * t_max + (sum(stage_times) - t_max) / max(1, v)
    busy = microbatches * sum(stage_times) / len(stage_times)
    return PipelineTime(step_s=step, busy_s=busy, bubble_s=step - microbatches * t_max)
