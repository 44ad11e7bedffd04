"""Token batches for ``meshplan run``: a nanoGPT-style token file, or synthetic tokens.

trace -> cost -> solve -> plan -> **run**. A token file is a flat binary array of uint16 or
uint32 token ids (what nanoGPT's ``prepare.py`` writes: ``np.array(ids, np.uint16).tofile``).
It is memory-mapped, never read whole. The batch of step ``s`` is ``global_batch`` windows of
``seq`` tokens whose starts are drawn from ``(seed, s)``, the same on every rank and for every
plan, so the losses of two plans are comparable and a resumed run sees the batches an
uninterrupted one would have seen.

The runtime takes a tensor shaped as the whole global batch on every rank and cuts its own
shard locally (runtime/graph/spmd.py ``_distribute`` with ``src_data_rank=None``, runtime/graph/lowering.py
``shard_of``), so a rank only needs its own rows: ``rows_read_by(plan, rank)`` names them (the
plan's microbatch split, then the batch dimension's sharding over the first stage's mesh
axes), and ``TokenFile.batch`` reads only those rows; the others stay zero and are never
read. Ranks of later pipeline stages read no rows at all.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from meshplan.errors import SpecError
from meshplan.plan import Plan
from meshplan.placements import REPLICATE, shard

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def window_starts(num_tokens: int, batch: int, seq: int, *, seed: int, step: int) -> torch.Tensor:
    """Start offsets of the ``batch`` windows of step ``step`` (as nanoGPT's get_batch draws
    them, from a generator seeded per step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, num_tokens - seq + 1, (batch,), generator=g)


class TokenFile:
    """A flat binary file of token ids, memory-mapped; checks its size on opening."""

    def __init__(self, path: str, dtype: str = "uint16"):
        if dtype not in TOKEN_DTYPES:
            raise SpecError(f"--data-dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
        if not os.path.isfile(path):
            raise SpecError(f"--data {path} does not exist or is not a file; pass a flat "
                            "binary of token ids (nanoGPT's train.bin)")
        self.path, self.dtype = path, np.dtype(TOKEN_DTYPES[dtype])
        size = os.path.getsize(path)
        if size == 0 or size % self.dtype.itemsize:
            raise SpecError(f"--data {path} has {size} bytes, not a positive multiple of "
                            f"{self.dtype.itemsize} ({dtype}); check the file or --data-dtype")
        self.num_tokens = size // self.dtype.itemsize
        self._tokens = np.memmap(path, dtype=self.dtype, mode="r")

    SAMPLE_TOKENS = 1 << 20  # the file's head checked before launch: 2 MiB of uint16

    def check_sample(self, vocab_size: int | None) -> None:
        """The first ``SAMPLE_TOKENS`` ids, read before any process starts. Rule 1 (uint16
        only): a uint32 file read as uint16 shows its ids' high halves at every odd position
        (little-endian, as numpy writes on x86 and ARM), and those are at most
        ``(vocab_size - 1) >> 16`` (0 without a vocabulary size): a head of at least 64
        values whose odd positions all stay within that bound while some even one exceeds it
        is refused (real uint16 token streams put ids of every size at odd positions). Rule
        2: no id in the head is ``vocab_size`` or more (a uint16 file read as uint32 gives
        ids of 65,536 and up). ``check_vocab`` repeats rule 2 on every batch while training."""
        head = np.asarray(self._tokens[:self.SAMPLE_TOKENS])
        high = (vocab_size - 1) >> 16 if vocab_size else 0
        if self.dtype == np.uint16 and len(head) >= 64 and int(head[1::2].max()) <= high \
                and int(head[0::2].max()) > high:
            raise SpecError(f"--data {self.path} looks like uint32 token ids read as uint16: "
                            f"every second 16-bit value of its first {len(head)} is at most "
                            f"{high}, as the high halves of uint32 ids are; pass --data-dtype "
                            "uint32")
        if vocab_size and len(head) and int(head.max()) >= vocab_size:
            other = "uint32" if self.dtype == np.uint16 else "uint16"
            raise SpecError(f"--data {self.path} holds token id {int(head.max())} in its first "
                            f"{len(head)} tokens, but the model's vocabulary has {vocab_size} "
                            f"ids; tokenize for this model, or check --data-dtype (now "
                            f"{self.dtype.name}, the other is {other})")

    def check_batch(self, batch: int, seq: int) -> None:
        if self.num_tokens < batch * seq:
            raise SpecError(f"--data {self.path} holds {self.num_tokens} tokens, fewer than one "
                            f"global batch of {batch} x {seq} = {batch * seq}; use more data or "
                            "a smaller plan batch")

    def batch(self, batch: int, seq: int, *, seed: int, step: int, rows=None) -> torch.Tensor:
        """The (batch, seq) int64 global batch of ``step``; only ``rows`` (default: all) are
        read from the file, the others are zero."""
        starts = window_starts(self.num_tokens, batch, seq, seed=seed, step=step).tolist()
        out = torch.zeros((batch, seq), dtype=torch.int64)
        for r in range(batch) if rows is None else rows:
            out[r] = torch.from_numpy(self._tokens[starts[r]:starts[r] + seq].astype(np.int64))
        return out

    def check_vocab(self, largest_id: int, vocab_size: int, step: int) -> None:
        if largest_id >= vocab_size:
            raise SpecError(f"--data {self.path} holds token id {largest_id} (step {step}), but "
                            f"the model's vocabulary has {vocab_size} ids; tokenize for this "
                            "model or check --data-dtype")


def rows_read_by(plan: Plan, rank: int) -> list[int]:
    """Rows of the global batch whose tokens ``rank`` feeds the model."""
    stage = plan.stages[0]
    devices = list(stage.devices)
    if rank not in devices:  # a later pipeline stage: activations come from its peers
        return []
    coord = np.unravel_index(devices.index(rank), tuple(stage.mesh_shape))
    placements = next(iter(stage.inputs.values()), (REPLICATE,) * len(stage.mesh_shape))
    rows = torch.arange(plan.training.global_batch)
    mine = []
    for chunk in rows.chunk(max(plan.training.microbatches, 1)):
        for axis, placement in enumerate(placements):  # DTensor shards axis by axis
            if placement == shard(0):
                chunk = chunk.chunk(stage.mesh_shape[axis])[coord[axis]] \
                    if coord[axis] < len(chunk.chunk(stage.mesh_shape[axis])) else chunk[:0]
        mine += chunk.tolist()
    return mine
