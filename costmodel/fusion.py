"""Compiled execution: which operators of a stage torch.compile fuses into one kernel, and
the price of such a kernel.

trace -> **cost** -> solve -> run. Eager PyTorch launches every elementwise, normalization,
activation and reduction operator as its own kernel, which reads its inputs from HBM and
writes its output back (``compute.op_time`` prices each so: roofline over its bytes plus the
per-kernel ``kernel_latency_s + framework_overhead_s``). Under ``torch.compile`` the
inductor backend fuses the pointwise and reduction operators between two matmuls (or
attention) into one generated kernel that loads only the chain's external inputs and
stores only the values read after it; its intermediates stay in registers (PyTorch 2 paper,
Ansel et al., ASPLOS 2024, section 5: inductor's scheduler fuses pointwise and reduction
nodes "vertically" when one reads the other's output). The backward graph AOTAutograd
builds is fused the same way.

The model here, a pure function of the OpGraph:

- fusible: ``OpKind`` ELEMENTWISE, NORM, SOFTMAX, REDUCTION; views join a group and cost
  nothing (as in eager); matmuls, attention, embeddings, losses and unknown operators end a
  group (inductor calls cuBLAS / the SDPA kernel for them, "extern kernels"), and so does
  any operator that reads or writes a complex tensor: inductor has no code generation for
  complex values and runs such an operator as its eager kernel (the multiply of torchtitan's
  rotary embedding, ``view_as_complex(x.float()) * freqs_cis``, with the fp32 value it reads
  materialized by the kernel before it).
- only operators of the repeated blocks (``layer >= 0``) fuse, each group inside one
  block: meshplan's ``compile=True`` and torchtitan compile each block on its own
  (``runtime/modules.py`` ``compile_blocks``; torchtitan ``apply_compile``), the embedding,
  the head and the loss run eagerly.
- a group is a connected set of fusible operators of one block at the same *depth*, the
  number of compute-bound operators on the longest path to them. Two operators with a
  matmul between them get different depths, so a group never waits on a kernel that reads
  its own output (it is convex: one kernel can run it).
- its forward reads each external input once and writes each value read outside the group
  once (views resolved to the tensor they alias); its backward, like every memory-bound
  operator's (``compute.op_time``), moves twice the forward's bytes: the output gradients
  and the saved inputs in, the input gradients out. One launch each way.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.costmodel.compute import DTYPE_BYTES, OpTime, roofline_s
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.kernel_paths import data_inputs, is_complex, materializes, value_dtype
from meshplan.costmodel.memory import alias_root
from meshplan.graph import OpGraph, OpKind

FUSIBLE = (OpKind.ELEMENTWISE, OpKind.NORM, OpKind.SOFTMAX, OpKind.REDUCTION)
TRANSPARENT = (OpKind.VIEW,)  # joins a group, moves nothing


@dataclass(frozen=True, slots=True)
class FusedGroup:
    """Operators one compiled kernel runs. ``reads``: (external tensor, member that reads
    it), each tensor once; ``writes``: members whose output is read after the group (or is
    the stage's output), views resolved to the member they alias. Bytes are the traced
    tensors' (fp32), scaled to the compute dtype where priced, as ``compute.op_time`` does."""

    members: tuple[str, ...]  # graph order, views included
    lead: str  # the first fusible member: the kernel is priced there (its split, its block)
    reads: tuple[tuple[str, str], ...]
    writes: tuple[str, ...]
    read_bytes: int
    written_bytes: int
    # of read_bytes, values a complex operator made (viewed as real): fp32 whatever the
    # compute dtype (complex64 is a pair of fp32), priced at their width
    fp32_read_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.written_bytes


def _tensor_bytes(graph: OpGraph, name: str) -> int:
    if name in graph:
        return sum(m.bytes for m in graph.node(name).outputs)
    if name in graph.param_map:
        p = graph.param_map[name]
        return p.numel * 4 if p.dtype.startswith(("float", "bfloat")) else p.numel
    return sum(m.bytes for n, m in graph.inputs if n == name)


def fusion_groups(graph: OpGraph, names) -> tuple[FusedGroup, ...]:
    """The kernels torch.compile makes of the fusible operators among ``names`` (a stage's
    operators, in graph order; an operator the engine does not run is left out of them):
    groups with at least one fusible operator; operators outside every group run as in
    eager. See the module docstring for the rule."""
    names = [n for n in names if n in graph]
    depth: dict[str, int] = {}
    for name in names:
        node = graph.node(name)
        depth[name] = max((depth[i] + (0 if _fuses(graph, i) else 1)
                           for i in node.inputs if i in depth), default=0)
    candidates = [n for n in names if _fuses(graph, n) and graph.node(n).layer >= 0]
    parent = {n: n for n in candidates}

    def find(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for name in candidates:
        node = graph.node(name)
        for i in node.inputs:
            if i in parent and depth[i] == depth[name] and graph.node(i).layer == node.layer:
                parent[find(i)] = find(name)
    groups: dict[str, list[str]] = {}
    for name in candidates:
        groups.setdefault(find(name), []).append(name)
    out = []
    for members in groups.values():
        if any(_works(graph, n) for n in members):
            out.append(_group(graph, members))
    return tuple(sorted(out, key=lambda g: graph.position(g.members[0])))


def _fuses(graph: OpGraph, name: str) -> bool:
    return name in graph and graph.node(name).kind in FUSIBLE + TRANSPARENT \
        and not _complex(graph, name)


def _works(graph: OpGraph, name: str) -> bool:
    """A member the kernel computes and may write: a fusible operator, or a view that
    copies (``kernel_paths.materializes``: repeat_kv's reshape of an expand)."""
    return graph.node(name).kind in FUSIBLE or materializes(graph, name)


def _complex(graph: OpGraph, name: str) -> bool:
    """Whether ``name`` writes or reads a complex tensor: inductor generates no code for
    complex arithmetic (torch/_inductor/lowering.py ``unsupported_input_tensor``) and runs
    it as eager ATen kernels, each a separate launch that reads and writes memory
    (tests/test_fusion_complex.py compiles torchtitan's rotary embedding and finds them).
    Every complex operator is treated so; inductor does decompose a complex ``add`` into
    real adds (torch/_inductor/decomposition.py), which no priced model has, and which this
    prices as an eager kernel, a little high."""
    node = graph.node(name)
    return any(is_complex(m.dtype) for m in node.outputs) or any(
        is_complex(value_dtype(graph, i)) for i in node.inputs)


def _group(graph: OpGraph, members: list[str]) -> FusedGroup:
    inside = set(members)
    reads: dict[str, str] = {}
    for name in members:
        for i in data_inputs(graph.node(name)):
            if i not in inside and i not in reads:
                reads[i] = name
    written: set[str] = set()
    for name in members:
        users = graph.users.get(name, ())
        if name == graph.output or not users or any(u not in inside for u in users):
            root = _producer(graph, name, inside)
            if root is not None:
                written.add(root)
    # a view member moves nothing: an external input read only through views is read by
    # the member behind them, and a value written is its fusible producer's output
    loaded = [t for t, reader in reads.items() if _reads_data(graph, reader, inside)]
    writes = tuple(n for n in members if n in written)
    lead = next(n for n in members if _works(graph, n))
    return FusedGroup(members=tuple(members), lead=lead, reads=tuple(reads.items()), writes=writes,
                      read_bytes=sum(_tensor_bytes(graph, t) for t in loaded),
                      written_bytes=sum(_tensor_bytes(graph, n) for n in writes),
                      fp32_read_bytes=sum(_tensor_bytes(graph, t) for t in loaded
                                          if _from_complex(graph, t)))


def _from_complex(graph: OpGraph, name: str) -> bool:
    """Whether ``name`` is a complex operator's result, or a view of one (``view_as_real``)."""
    for _ in range(64):
        if name not in graph:
            return is_complex(value_dtype(graph, name))
        node = graph.node(name)
        if any(is_complex(m.dtype) for m in node.outputs):
            return True
        if node.kind not in TRANSPARENT or not node.inputs:
            return False
        name = node.inputs[0]
    return False


def runs_eager(graph: OpGraph, name: str) -> bool:
    """Whether a block operator runs as its eager kernel under torch.compile though it is
    memory-bound: one that reads or writes a complex tensor (``_complex``), and a cast whose
    value such an operator reads (through views), which a kernel of its own materializes
    (inductor's ``view_as_complex(x.float())`` before torchtitan's rotary multiply)."""
    if name not in graph:
        return False
    if _complex(graph, name):
        return True
    if not _cast(graph, name):
        return False
    frontier, seen = [name], set()
    while frontier:
        for u in graph.users.get(frontier.pop(), ()):
            if u in seen or u not in graph:
                continue
            seen.add(u)
            if _complex(graph, u):
                return True
            if graph.node(u).kind in TRANSPARENT:
                frontier.append(u)
    return False


def _producer(graph: OpGraph, name: str, inside: set[str]) -> str | None:
    """The fusible member whose output ``name`` is (through views), None when ``name`` is a
    view of a tensor from outside the group (nothing to write)."""
    for _ in range(64):
        node = graph.node(name)
        if node.kind not in TRANSPARENT or materializes(graph, name):
            return name
        src = next((i for i in node.inputs if i in inside), None)
        if src is None:
            return None
        name = src
    return None


def _reads_data(graph: OpGraph, reader: str, inside: set[str]) -> bool:
    """Whether the external input ``reader`` takes is loaded by the kernel: a fusible reader
    loads it; a view reader loads it when some fusible member reads the view (directly or
    through further views)."""
    if _works(graph, reader):
        return True
    frontier, seen = [reader], set()
    while frontier:
        n = frontier.pop()
        for u in graph.users.get(n, ()):
            if u in inside and u not in seen:
                seen.add(u)
                if _works(graph, u):
                    return True
                frontier.append(u)
    return False


def _cast(graph: OpGraph, name: str) -> bool:
    return graph.node(name).target.startswith(("aten.to.", "aten._to_copy."))


def fused_by_member(graph: OpGraph, names) -> dict[str, FusedGroup]:
    """Each fusible operator of ``names`` that compiles into a group -> its group (views
    are left out: they cost nothing either way)."""
    return {n: g for g in fusion_groups(graph, names) for n in g.members
            if _works(graph, n)}


def fused_time(group: FusedGroup, hw: HardwareProfile, dtype: str, shard: float, *,
               contention: float = 1.0) -> OpTime:
    """Forward and backward time of one fused kernel whose work ``shard`` devices (and
    microbatches) split: one roofline over its external bytes plus one fixed cost each way."""
    dev = hw.device
    narrow = (group.bytes - group.fp32_read_bytes) * DTYPE_BYTES.get(dtype, 4) / 4
    nbytes = (narrow + group.fp32_read_bytes) / shard
    fixed = dev.kernel_latency_s + dev.framework_overhead_s
    forward = (roofline_s(hw, 0.0, nbytes, dtype) + fixed) * contention
    backward = (roofline_s(hw, 0.0, 2.0 * nbytes, dtype) + fixed) * contention
    return OpTime(forward, backward)


def recomputed_inside(graph: OpGraph, names) -> dict[str, tuple[str, ...]]:
    """What a fused kernel's backward rebuilds instead of keeping: each intermediate of a
    group (a member whose value no operator outside the group reads) -> the tensors the
    group materializes anyway that it derives from (the group's external inputs and the
    values it writes), weights left out.

    Activation memory of fused kernels: a fused backward recomputes its intermediates from
    what it saved, so a tensor eager autograd keeps inside the chain (the fp32 copy and the
    normalized value of an RMSNorm, the SiLU output of SwiGLU) costs only the
    materialized tensors it comes from. Transformer Engine's fused RMSNorm in
    ``LayerNormLinear`` keeps its input and the per-row rstd (``ln_out`` is the GEMM's
    input); Megatron-Core's fused SwiGLU (``bias_swiglu_impl``, ``SwiGLUFunction``) keeps
    only the fc1 output; its fused RoPE (``apply_rope_fusion``) only the frequencies
    (Megatron-Core 0.16.1, megatron/core/fusions/fused_bias_swiglu.py, fused_rope via
    Transformer Engine). Groups as ``fusion_groups`` finds them."""
    out: dict[str, tuple[str, ...]] = {}
    for group in fusion_groups(graph, names):
        inside = set(group.members)
        written = set(group.writes)
        memo: dict[str, tuple[str, ...]] = {}
        # a dtype cast inside a fused kernel happens in registers (TE's norms read bf16 and
        # compute in fp32): never materialized, whoever reads it (a trace in fp32 shares
        # one no-op cast between the norm and the residual add)
        written -= {n for n in written if _cast(graph, n)}

        def sources(name: str, depth: int = 0) -> tuple[str, ...]:
            if name in memo:
                return memo[name]
            found: list[str] = []
            for i in graph.node(name).inputs:
                root = alias_root(i, graph)
                if root in graph.param_map:
                    continue
                if root in inside and root not in written and depth < 64:
                    found += [s for s in sources(root, depth + 1) if s not in found]
                elif root not in found:
                    found.append(root)
            memo[name] = tuple(found)
            return memo[name]

        for name in group.members:
            users = graph.users.get(name, ())
            if _cast(graph, name) or (name != graph.output and users and name not in written
                                      and all(u in inside for u in users)):
                out[name] = sources(name)
    return out
