"""Context parallelism (cp) on the module engine, with PyTorch's own mechanism.

trace -> cost -> solve -> plan -> **run**. The way torchtitan runs it: inside
``torch.distributed.tensor.experimental.context_parallel`` the model's inputs are cut into
2 x cp chunks, cp rank r keeping chunks r and 2cp-1-r (its ``_HeadTailLoadBalancer``, the
layout of meshplan/context.py); ``F.scaled_dot_product_attention`` is patched so that each
call becomes ring attention over the cp group: K and V all-gathered once per call
(``set_rotate_method("allgather")``, as Llama 3 does; gloo has no all-to-all for the
forward rotation), causal blocks above the diagonal skipped, no mask materialised; the
backward sends dK/dV back with torch's all-to-all rotater. Everything else (projections,
norms, MLP, head, loss) runs on the rank's s / cp positions.

What meshplan adds around it:

- **the CPU attention op** (``CpuFlashAdapter`` below). Upstream maps only the CUDA SDPA
  ops (flash, efficient, cuDNN) to ring attention; on CPU, SDPA dispatches to
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (output, logsumexp of shape
  (B, H, L), the same convention as CUDA flash) and its ``_backward``, which upstream does
  not handle. The adapter hands that op pair to the same templated ring functions
  (``_templated_ring_attention`` and ``_backward`` take the attention op as an argument);
  on CUDA the stock handlers run unchanged. Checked against one process in fp64 on 2 and 4
  gloo ranks, causal and not, forward and backward (tests/test_cp_modules.py).
- **positions follow the chunks** (``ChunkPositions``): torchtitan shards its rotary
  table as a cp buffer; models compute positions as ``torch.arange(s)`` (nanoGPT, HF's
  ``cache_position``) or slice a table ``table[:s]`` with the local ``s``. Inside the cp
  region both are answered with this rank's global positions (the load-balanced index), and
  HF models get ``position_ids`` too.
- **the loss on each rank's chunk**, summed and divided by the labelled tokens (labels
  != -100) of the GLOBAL batch, times the size of the mesh fully_shard averages gradients
  over (dp x cp), so gradients equal one process; eval outputs are un-sharded into natural
  order (``context_parallel_unshard``).

The module-level switches of torch's prototype (load balancing, rotate method, SDPA
handlers) are set on entering the region and restored on leaving it.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import (context_parallel_unshard,
                                                              set_rotate_method)
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from meshplan.errors import NotSupportedError
from meshplan.runtime.loss_weights import IGNORE_INDEX  # labels that do not count
from meshplan.vocabulary import LossReduction

aten = torch.ops.aten
_SEQ = 2  # SDPA's (batch, heads, sequence, head_dim): the dim the chunks cut
# the kernels torch's ring attention computes blocks with; the math kernel would run on
# sequence-sharded DTensors with a mask from global shapes, wrong under the layout
_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.CUDNN_ATTENTION]


# -- the CPU flash-attention op on torch's ring attention ---------------------------------------

def _spec(local: torch.Tensor, mesh) -> DTensorSpec:
    """A Shard(2) spec over ``mesh`` whose global tensor has ``local``'s stride order."""
    shape = list(local.shape)
    shape[_SEQ] *= mesh.size()
    stride, step = [0] * local.dim(), 1
    for d in sorted(range(local.dim()), key=lambda d: local.stride(d)):
        stride[d], step = step, step * shape[d]
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensorSpec(mesh, (Shard(_SEQ),), tensor_meta=meta)


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def _refuse_mask(mask) -> None:
    if mask is not None:
        raise NotSupportedError("cp: an attention call passed an explicit attn_mask; torch's "
                                "context parallelism splits is_causal=True or unmasked "
                                "attention only; drop the mask (use is_causal=True)")


def _cpu_flash(op_call, args, kwargs):
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *,
    attn_mask, scale)`` on Shard(2) DTensors -> ring attention -> (out, logsumexp)."""
    names = ("query", "key", "value", "dropout_p", "is_causal")
    a = {**dict(zip(names, args)), **kwargs}
    _refuse_mask(a.get("attn_mask"))
    mesh = a["query"].device_mesh
    out, lse = _cp._templated_ring_attention(
        mesh.get_group(), _SEQ, aten._scaled_dot_product_flash_attention_for_cpu.default,
        _local(a["query"]), _local(a["key"]), _local(a["value"]),
        is_causal=bool(a.get("is_causal", False)), dropout_p=a.get("dropout_p", 0.0),
        scale=a.get("scale"))
    return DTensor._op_dispatcher.wrap((out, lse), (_spec(out, mesh), _spec(lse, mesh)))


def _cpu_flash_backward(op_call, args, kwargs):
    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    a = {k: _local(v) for k, v in {**dict(zip(names, args)), **kwargs}.items()}
    _refuse_mask(a.get("attn_mask"))
    mesh = (args[1] if len(args) > 1 else kwargs["query"]).device_mesh
    grads = _cp._templated_ring_attention_backward(
        mesh.get_group(), _SEQ, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=a["grad_out"], grad_out_name="grad_out", query=a["query"], key=a["key"],
        value=a["value"], out=a["out"], logsumexp=a["logsumexp"],
        is_causal=bool(a["is_causal"]), dropout_p=a["dropout_p"], scale=a.get("scale"))
    return DTensor._op_dispatcher.wrap(tuple(grads), tuple(_spec(g, mesh) for g in grads))


CPU_HANDLERS = {aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_flash,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                    _cpu_flash_backward}


@contextlib.contextmanager
def cp_region(cp_mesh, buffers: list[torch.Tensor], seq_dims: list[int], *, causal: bool):
    """torch's ``context_parallel`` over ``cp_mesh``: ``buffers`` (tensors of this step, not
    the user's) are cut in place into this rank's chunks, SDPA is ring attention (plus the
    CPU op); head-tail load balancing for causal attention, contiguous chunks otherwise
    (torch balances causal attention only)."""
    set_rotate_method("allgather")
    before = _cp._cp_options.enable_load_balance
    _cp._cp_options.enable_load_balance = causal
    try:
        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims,
                              no_restore_buffers=set(buffers)):
            dispatcher = DTensor._op_dispatcher
            dispatcher._custom_op_handlers = {**dispatcher._custom_op_handlers, **CPU_HANDLERS}
            with sdpa_kernel(_KERNELS):
                yield
    finally:
        _cp._cp_options.enable_load_balance = before


def unshard(cp_mesh, value: torch.Tensor, *, causal: bool, seq_dim: int = 1) -> torch.Tensor:
    """This rank's chunks of ``value`` gathered over cp, in natural sequence order."""
    before = _cp._cp_options.enable_load_balance
    _cp._cp_options.enable_load_balance = causal
    try:
        return context_parallel_unshard(cp_mesh, [value], [seq_dim])[0]
    finally:
        _cp._cp_options.enable_load_balance = before


# -- positions follow the chunks ---------------------------------------------------------------

class ChunkPositions(TorchFunctionMode):
    """Inside the model's forward, the two ways code derives positions from the (local)
    sequence length return this rank's global positions instead:
    ``torch.arange(s)`` / ``torch.arange(0, s)`` and a slice ``table[:s]`` (or
    ``table[:, :s]``) of one of the model's buffers or parameters at least as long as the
    global sequence. ``positions``: this rank's global positions (length s = global / cp)."""

    def __init__(self, positions: torch.Tensor, buffers, global_len: int):
        super().__init__()
        self.positions, self.global_len = positions, global_len
        self.buffers = {id(b) for b in buffers}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        n = self.positions.numel()
        if func is torch.arange and self._is_range(args, kwargs, n):
            return self.positions.to(dtype=out.dtype, device=out.device)
        # a buffer, or a parameter (a learned table, ``self.pos[:t]``: FSDP2 hands the forward
        # an unsharded copy, so parameters are recognised by type, not by identity)
        if func is torch.Tensor.__getitem__ and (id(args[0]) in self.buffers
                                                 or isinstance(args[0], nn.Parameter)):
            dim = self._sliced_dim(args[0], args[1], n)
            if dim is not None:
                return args[0].index_select(dim, self.positions.to(args[0].device))
        return out

    @staticmethod
    def _is_range(args, kwargs, n: int) -> bool:
        vals = [int(v) if isinstance(v, (int, torch.Tensor)) and not isinstance(v, bool)
                and (not isinstance(v, torch.Tensor) or v.numel() == 1) else None for v in args]
        if kwargs.get("start", 0) != 0 or kwargs.get("step", 1) != 1 or None in vals:
            return False
        if len(vals) == 1:
            return vals[0] == n
        return vals[0] == 0 and vals[1] == n and (len(vals) == 2 or vals[2] == 1)

    def _sliced_dim(self, table: torch.Tensor, index, n: int) -> int | None:
        index = index if isinstance(index, tuple) else (index,)
        for dim, item in enumerate(index):
            if item == slice(None):
                continue
            if isinstance(item, slice) and item.start in (None, 0) and item.step in (None, 1) \
                    and item.stop == n and table.shape[dim] >= self.global_len \
                    and all(i in (Ellipsis, slice(None)) for i in index[dim + 1:]):
                return dim
            return None
        return None


# -- what a step runs -------------------------------------------------------------------------

class AttentionCalls(TorchFunctionMode):
    """Records (has mask, is_causal, dropout_p > 0) of every SDPA call of a forward on meta
    (runtime/module_plan.cp_refusal). A data-dependent branch on a meta tensor (``bool(t)``,
    ``t.item()`` of a boolean) is answered True: transformers asks "is the mask all ones?"
    and "are the positions one unpacked sequence?", which the cp region's all-ones mask and
    global positions answer so (``call_kwargs``); it then passes is_causal=True, as it does
    at run time, while a model that always builds a mask (T5's position bias) still shows it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[bool, bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__bool__, torch.Tensor.item) and args and \
                isinstance(args[0], torch.Tensor) and args[0].is_meta and \
                args[0].dtype == torch.bool:
            return True
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
            a = {**dict(zip(names, args)), **kwargs}
            self.calls.append((a.get("attn_mask") is not None, bool(a.get("is_causal", False)),
                               float(a.get("dropout_p", 0.0)) > 0))
        return func(*args, **kwargs)


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels of the language-model default: token t+1 for position t, the last ignored."""
    pad = torch.full_like(ids[:, :1], IGNORE_INDEX)
    return torch.cat([ids[:, 1:], pad], dim=1)


def _takes(model: nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def call_kwargs(model: nn.Module, positions: torch.Tensor, rows: int, kwargs: dict) -> dict:
    """``kwargs`` plus the global positions for a model that takes ``position_ids``; a model
    that also takes ``attention_mask`` (transformers) and gets none is told "no padding":
    transformers reads jumps in position_ids without a mask as packed sequences and builds a
    mask, while with an all-ones mask it passes is_causal=True to SDPA."""
    if not _takes(model, "position_ids") or "position_ids" in kwargs:
        return kwargs
    out = {**kwargs, "position_ids": positions.unsqueeze(0).expand(rows, -1)}
    if _takes(model, "attention_mask") and "attention_mask" not in kwargs:
        out["attention_mask"] = torch.ones(rows, positions.numel(), dtype=torch.long,
                                           device=positions.device)
    return out


@contextlib.contextmanager
def chunked(cp_mesh, tensors, seq: int, modules, *, device, causal: bool = True):
    """The cp region of one step: copies of ``tensors`` (sequence on dim 1) are cut into this
    rank's chunks and this rank's global positions follow (``ChunkPositions`` over the
    buffers of ``modules``). Yields (the cut copies, the positions)."""
    cut = [x.clone() for x in tensors]
    positions = torch.arange(seq, device=device)
    with cp_region(cp_mesh, cut + [positions], [1] * len(cut) + [0], causal=causal):
        buffers = [b for m in modules for b in m.buffers()]
        with ChunkPositions(positions, buffers, seq):
            yield cut, positions


@contextlib.contextmanager
def chunked_call(model: nn.Module, cp_mesh, args: tuple, kwargs: dict, extra=(), *,
                 causal: bool = True):
    """The cp region around calls of ``model``: ``args``/``kwargs`` tensors with the
    sequence on dim 1 and ``extra`` (labels) cut into this rank's chunks, the global
    positions following. Yields (args, kwargs, extra) to call the model with."""
    seq = args[0].shape[1]

    def seqlong(x):
        return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq
    keys = [("a", i) for i, x in enumerate(args) if seqlong(x)] + \
        [("k", k) for k, v in kwargs.items() if seqlong(v)]
    whole = [args[i] if kind == "a" else kwargs[i] for kind, i in keys] + list(extra)
    with chunked(cp_mesh, whole, seq, [model], device=args[0].device, causal=causal) \
            as (cut, positions):
        args, kwargs = list(args), dict(kwargs)
        for (kind, i), x in zip(keys, cut):
            if kind == "a":
                args[i] = x
            else:
                kwargs[i] = x
        kwargs = call_kwargs(model, positions, args[0].shape[0], kwargs) \
            if len(args) == 1 else kwargs
        yield tuple(args), kwargs, tuple(cut[len(keys):])


def chunk_loss_sum(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over this rank's labelled positions (fp32)."""
    out = out.full_tensor() if isinstance(out, DTensor) else out
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


# -- the user's loss_fn on each rank's chunk --------------------------------------------------
#
# The step's loss is ``sum(S) / D``: S is each chunk's share (over every rank, microbatch and
# cp chunk), D the global batch's denominator. ``mean`` (loss_fn a per-token mean over labels
# != -100): S = loss_fn(chunk) x the chunk's labelled tokens, D = the global batch's labelled
# tokens (torchtitan divides by the global token count the same way). ``sum``: S =
# loss_fn(chunk), D = 1. ``sequence`` (each row's labelled mean, averaged over rows): S = sum
# over the chunk's rows of loss_fn(row's chunk) x its labelled tokens / the row's labelled
# tokens over every chunk, D = the global batch's rows.

def labelled(targets: tuple) -> torch.Tensor:
    """(rows, positions) mask of the positions that count: the first target's entries !=
    -100 when it holds integer labels, every position otherwise."""
    first = targets[0]
    if first.is_floating_point() or first.dtype == torch.bool:
        return torch.ones(first.shape[:2], dtype=torch.bool, device=first.device)
    return first != IGNORE_INDEX


def _zero(out: torch.Tensor) -> torch.Tensor:
    """A zero loss that still reaches every parameter's backward hook (FSDP's sync)."""
    return out.sum() * 0.0


def chunk_loss(out, targets: tuple, loss_fn, reduction: str, row_totals) -> torch.Tensor:
    """This chunk's share S of the step's loss (above). ``targets``: the chunk's targets
    (positions on dim 1); ``row_totals(rows)``: each row's labelled tokens over every cp
    chunk, from this chunk's (a sum over the cp group; ``sequence`` only)."""
    out = out.full_tensor() if isinstance(out, DTensor) else out
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    if reduction == LossReduction.SUM:
        return loss_fn(out, *targets)
    mask = labelled(targets)
    if reduction == LossReduction.MEAN:
        k = int(mask.sum())
        return loss_fn(out, *targets) * k if k else _zero(out)
    rows = mask.sum(1).to(torch.float64)
    whole = row_totals(rows)
    parts = [loss_fn(out[b:b + 1], *(t[b:b + 1] for t in targets)) * float(rows[b] / whole[b])
             for b in range(out.shape[0]) if rows[b] > 0]
    return torch.stack(parts).sum() if parts else _zero(out)


def loss_denominator(targets: tuple, reduction: str, dp_size: int = 1) -> torch.Tensor:
    """This data-parallel shard's part of D (the caller sums it over the dp ranks), float64."""
    mask = labelled(targets)
    if reduction == LossReduction.SUM:
        return torch.full((), 1.0 / dp_size, dtype=torch.float64, device=mask.device)
    if reduction == LossReduction.SEQUENCE:
        return torch.tensor(float(mask.shape[0]), dtype=torch.float64, device=mask.device)
    return mask.sum().to(torch.float64)


def row_totals_over(cp_mesh):
    """``chunk_loss``'s row_totals: a sum over the cp group."""
    def total(rows: torch.Tensor) -> torch.Tensor:
        whole = rows.clone()
        dist.all_reduce(whole, group=cp_mesh.get_group())
        return whole
    return total


def _head_tail(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    pieces = x.chunk(2 * cp, dim=1)
    return torch.cat([pieces[rank], pieces[2 * cp - 1 - rank]], dim=1)


def loss_split_refusal(loss_fn, out_shape, targets, reduction: str, cp: int) -> str | None:
    """Why ``loss_fn`` cannot be computed on cp chunks and combined as ``reduction`` says
    (None when it can): every target must hold a value per position (rows, positions, ...),
    and on random outputs and targets (a quarter of the labels -100) the chunks' combination
    must equal the loss of the whole sequence, in float64. A loss that shifts its targets
    inside, or adds a term over every position, fails the second rule."""
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    seq = out_shape[1] if len(out_shape) >= 2 else None
    fix = ("pass token-aligned targets (targets[:, t] for position t) to a loss_fn(outputs, "
           "*targets) that returns a per-token mean over labels != -100, declare "
           "loss_reduction='sum' or 'sequence', or use cp=1")
    if not targets:
        return f"loss_fn {name} with cp={cp} gets no targets, so its loss cannot be split " \
               f"by position; {fix}"
    for i, t in enumerate(targets):
        if t.dim() < 2 or seq is None or t.shape[1] != seq:
            return (f"loss_fn {name} with cp={cp}: target {i} has shape {list(t.shape)}, not "
                    f"one value per position of the outputs' {list(out_shape)}; cp splits the "
                    f"loss by position; {fix}")
    g = torch.Generator().manual_seed(0)
    rows = min(3, out_shape[0])
    # outputs larger and labels sparser along the sequence, and each row labelled
    # differently: any term that is not weighed as declared changes the combination
    ramp = torch.linspace(1.0, 4.0, seq, dtype=torch.float64)
    out = torch.randn((rows, *out_shape[1:]), generator=g, dtype=torch.float64) * \
        ramp.view(1, seq, *[1] * (len(out_shape) - 2))
    made = []
    for t in targets:
        shape = (rows, *t.shape[1:])
        if t.is_floating_point():
            made.append(torch.randn(shape, generator=g, dtype=torch.float64))
        else:
            v = torch.randint(0, max(1, out_shape[-1]), shape, generator=g, dtype=t.dtype)
            odds = (torch.linspace(0.05, 0.6, seq).view(1, seq) +
                    0.15 * torch.arange(rows).view(rows, 1)).view(rows, seq, *[1] * (len(shape) - 2))
            drop = torch.rand(shape, generator=g) < odds
            drop[:, 0] = False  # every row keeps a label
            made.append(v.masked_fill(drop, IGNORE_INDEX) if t.dtype != torch.bool else v)
    try:
        whole = float(loss_fn(out, *made))
        mask = labelled(tuple(made))
        totals = mask.sum(1).to(torch.float64)
        shares = sum(float(chunk_loss(_head_tail(out, cp, r),
                                      tuple(_head_tail(t, cp, r) for t in made), loss_fn,
                                      reduction, lambda _rows: totals))
                     for r in range(cp))
        split = shares / float(loss_denominator(tuple(made), reduction))
    except Exception as exc:  # noqa: BLE001 - any failure on a chunk means "not splittable"
        return (f"loss_fn {name} with cp={cp} fails on a sequence chunk ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); {fix}")
    if not abs(split - whole) <= 1e-6 * max(1.0, abs(whole)):
        return (f"loss_fn {name} with cp={cp}: on random data its cp chunks combined as "
                f"loss_reduction={reduction!r} give {split:.6g}, the whole sequence {whole:.6g}; "
                f"it is not a {reduction} over labelled positions; {fix}")
    return None


# -- pipelines (runtime/module_pipeline.py) -------------------------------------------------

@contextlib.contextmanager
def pipeline_region(engine, tensors: list[torch.Tensor]):
    """PipelineModuleEngine's cp region of one schedule run: ``tensors`` cut into this
    rank's chunks, the stage modules given this rank's global positions."""
    seq = tensors[0].shape[1]
    with chunked(engine.cp_mesh, tensors, seq, engine.modules,
                 device=engine.device) as (cut, positions):
        for m in engine.modules:
            m.cp_positions = positions
        try:
            yield cut
        finally:
            for m in engine.modules:
                m.cp_positions = None


def pipeline_train_step(engine, args: tuple, targets: tuple) -> float:
    """PipelineModuleEngine.train_step under context parallelism: every microbatch's loss
    on this rank's chunks (the user's loss_fn weighted as ``chunk_loss`` says), summed over
    labelled tokens and divided by those of the global batch, times the microbatches (the schedule divides gradients by them) and the dp x cp
    ranks fully_shard averages over: gradients as one process's."""
    n = engine.plan.training.microbatches
    ids = args[0].to(engine.device)
    if engine.loss_fn is not None and not targets:
        raise NotSupportedError("loss_fn with cp > 1 and no targets: cp splits the loss by "
                                "position; pass token-aligned targets, or use cp=1")
    labels = (targets[0] if targets else next_token_labels(args[0])).to(engine.device)
    reduction = engine.loss_reduction if engine.loss_fn is not None else LossReduction.MEAN
    counted = loss_denominator((labels,), reduction, engine.dp_size).to(engine.device)
    if engine.dp_group is not None:
        dist.all_reduce(counted, group=engine.dp_group)
    engine._cp_scale = n * engine.fsdp_mesh.size() / max(counted.item(), 1.0)
    engine._cp_sums, engine._targets_mode = [], ("cp",)
    with pipeline_region(engine, [ids, labels]) as (ids, labels):
        engine.schedule.step(*((ids,) if engine.has_first else ()),
                             target=labels if engine.has_last else None,
                             losses=[] if engine.has_last else None)
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    if engine.has_last:
        # the last n: the first step's shape inference calls the loss on empty tensors
        total += torch.stack([x.double() for x in engine._cp_sums[-n:]]).sum()
    dist.all_reduce(total, group=engine.fsdp_mesh.get_group())
    dist.all_reduce(total, group=engine.pp_group)  # only the last stage's ranks add a loss
    return float(total.item() / max(counted.item(), 1.0))
