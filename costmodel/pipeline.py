"""Pipeline schedules: step time from per-microbatch stage times, bubble, in-flight work.

trace -> **cost** -> solve -> run. Used by estimate.py for every plan and by the pipeline
planner for its candidates. With p stages of per-microbatch times t_i (forward + backward
+ recompute + exposed communication of one microbatch), m microbatches and v virtual
stages per device (interleaved 1F1B):

    step = m * max(t) + (sum(t) - max(t)) / v

For equal stages this is (m + (p - 1) / v) * t: the bubble fraction (p - 1) / (v m) of
Narayanan et al. 2021 (section 2.2, eq. 1 and the interleaved schedule), and for v = 1 it
is Alpa's latency sum(t) + (m - 1) * max(t) (Zheng et al. 2022, eq. 2). GPipe and 1F1B have
the same bubble; they differ in memory (memory.inflight_microbatches). ``busy_ranks`` turns
the schedule into the number of ranks computing at once, which sets the CPU contention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.errors import PlanningError
from meshplan.schedules import SCHEDULES, Schedule, virtual_stages_for


@dataclass(frozen=True, slots=True)
class PipelineTime:
    step_s: float  # time of the pipelined forward/backward of all microbatches
    busy_s: float  # m x mean stage time: the work of the average stage
    bubble_s: float  # step_s - m x max stage time (idle time of the bottleneck stage)

    @property
    def bubble_fraction(self) -> float:
        return (self.step_s - self.busy_s) / self.step_s if self.step_s else 0.0


def pipeline_step_time(stage_times: Sequence[float], microbatches: int,
                       schedule: str = Schedule.ONE_F_ONE_B,
                       virtual_stages: int = 1) -> PipelineTime:
    """Step time of the pipelined part of a training step (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise PlanningError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if microbatches < 1 or not stage_times:
        raise PlanningError(f"microbatches={microbatches} and {len(stage_times)} stages: need "
                            "at least one of each")
    v = virtual_stages_for(schedule, virtual_stages)
    t_max = max(stage_times)
    step = microbatches * t_max + (sum(stage_times) - t_max) / max(1, v)
    busy = microbatches * sum(stage_times) / len(stage_times)
    return PipelineTime(step_s=step, busy_s=busy, bubble_s=step - microbatches * t_max)


def chunked_step_time(group_s: Sequence[float], slowest_chunk_s: float,
                      microbatches: int) -> PipelineTime:
    """Step time of interleaved 1F1B whose p rank groups hold chunks of different sizes.

    Group g works T_g = the sum of its chunks' per-microbatch times on every microbatch;
    filling and draining the pipeline passes a microbatch through p - 1 chunks before the
    slowest group is busy, each step gated by the slowest chunk c:

        step = m * max(T) + (p - 1) * c

    With v equal chunks per group (c = T / v) this is the interleaved formula of
    ``pipeline_step_time``, (m + (p - 1) / v) * T (Narayanan et al. 2021, section 2.2).
    """
    if microbatches < 1 or not group_s:
        raise PlanningError(f"microbatches={microbatches} and {len(group_s)} rank groups: need "
                            "at least one of each")
    step = microbatches * max(group_s) + (len(group_s) - 1) * slowest_chunk_s
    busy = microbatches * sum(group_s) / len(group_s)
    return PipelineTime(step_s=step, busy_s=busy, bubble_s=step - microbatches * max(group_s))


def busy_ranks(stage_compute_s: Sequence[float], stage_ranks: Sequence[int], microbatches: int,
               step_s: float) -> float:
    """Average number of ranks computing at the same time during the pipelined span.

    Stage i has r_i ranks (its tensor/data-parallel devices), each working t_i per
    microbatch (the stage time the schedule uses: forward + backward + recompute + the
    stage's own communication - gloo's collectives copy and reduce on the CPU too, and a
    data-parallel run then keeps all its ranks busy, as ``meshplan calibrate`` assumes when
    it fits the effective cores), m times per step. Over the span ``step_s``
    (``pipeline_step_time``, the same schedule formula) they work sum_i r_i m t_i
    rank-seconds; the rest of the span is the bubble, where a rank sleeps in a blocking
    receive and leaves its core to the busy ones. On average

        busy = sum_i r_i m t_i / step_s

    ranks work at once. For p equal stages of r ranks and v = 1 this is
    r p m t / ((m + p - 1) t) = r p m / (m + p - 1), i.e. r p (1 - bubble fraction):
    4 stages and 4 microbatches keep 16/7 = 2.3 of 4 ranks busy; one stage keeps all r.
    """
    if step_s <= 0:
        return float(sum(stage_ranks))
    work = sum(r * microbatches * c for r, c in zip(stage_ranks, stage_compute_s))
    return min(float(sum(stage_ranks)), work / step_s)
