"""Pipeline schedules: the one list of names the plan file, the planner, the cost model and
the runtime share.

trace -> cost -> solve -> **plan** -> run. ``gpipe`` runs every forward, then every
backward (Huang et al. 2019); ``1f1b`` alternates them once the pipeline is full, which
keeps at most ``pp`` microbatches in flight (Narayanan et al. 2021, PipeDream-Flush);
``interleaved-1f1b`` gives each rank ``virtual_stages`` chunks of layers (Narayanan et al.
2021, section 2.2). The runtime maps each name to a ``torch.distributed.pipelining``
schedule class (``runtime/graph/pipeline.py``).
"""

from __future__ import annotations

from enum import StrEnum


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"


SCHEDULES = tuple(s.value for s in Schedule)  # ("gpipe", "1f1b", "interleaved-1f1b")
