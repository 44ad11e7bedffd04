"""What both runtime engines use: the module engine (runtime/modules.py,
runtime/module_pipeline.py) and the graph engine (runtime/graph/) share code only through
this module and runtime/engine.py, so neither engine imports the other (issue 40: the two
were one import cycle of 9 modules, tools/import_cycles.py).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from meshplan.schedules import Schedule
from meshplan.vocabulary import ComputeDtype

# the dtype each of meshplan's dtypes computes in on a runtime (None: as stored, fp32); which
# engine runs which: vocabulary.ENGINE_DTYPES
COMPUTE_DTYPES = {ComputeDtype.FP32: None, ComputeDtype.BF16: torch.bfloat16,
                  ComputeDtype.FP16: torch.float16}

# meshplan's schedule names -> torch's classes, for both engines' pipelines
TORCH_SCHEDULES = {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B,
                   Schedule.INTERLEAVED: ScheduleInterleaved1F1B}


def meta_copy(model: nn.Module) -> nn.Module:
    """The same module with every parameter and buffer on the meta device (ties kept),
    without copying any weight."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def broadcast_from_last(out: torch.Tensor | None, group, device) -> torch.Tensor:
    """``out`` of the pipeline lane's last rank (``group``'s highest rank, where the last
    stage runs) on every rank of the lane: its shape and dtype first, then the tensor."""
    last = dist.get_world_size(group) - 1
    mine = dist.get_rank(group) == last
    meta = [(tuple(out.shape), out.dtype) if mine else None]
    dist.broadcast_object_list(meta, group_src=last, group=group)
    buf = out if mine else torch.empty(meta[0][0], dtype=meta[0][1], device=device)
    dist.broadcast(buf, group_src=last, group=group)
    return buf
