"""Memory per device: model state (params, grads, optimizer), activations, buffers.

trace -> **cost** -> solve -> run. Pure functions of sizes; estimate.py applies them to a
plan's stages and the pipeline planner calls them for its stage candidates.

Model state, bytes per parameter on the device that keeps it (Megatron-LM
distributed-optimizer docs, table "bytes per parameter"; ZeRO, Rajbhandari et al. 2020,
section 3.1):

================= ======= ============== =====================================
dtype             weights gradients      optimizer (adam / sgd)
================= ======= ============== =====================================
fp32              4       4              8 moments / 4 momentum
bf16, fp16        2       4 (fp32 main)  4 master + 8 moments / 4 master + 4 mom.
================= ======= ============== =====================================

so 16 bytes per parameter for fp32 Adam and 18 for mixed-precision Adam (Megatron's table).
ZeRO over the data-parallel group of size d: stage 1 divides the optimizer column by d,
stage 2 also the gradients, stage 3 also the weights (ZeRO paper, figure 1); ZeRO-3 then
keeps gathered weights of the layers in flight (``zero3_buffer_bytes``).

Activations: a tensor is kept for backward when an operator's backward needs it
(``saved_inputs``): a matmul keeps its activation inputs, a norm its input, a softmax its
output, an elementwise op its inputs unless it is linear (add, sub, neg), a loss its
logits; views keep nothing and alias their base, so each base tensor counts once; an
operator none of whose inputs needs a gradient keeps nothing, and a product keeps an
operand only where the other one needs a gradient (what eager autograd saves). The
backward starts with the loss's gradients while all of them are kept
(``loss_grad_bytes``). Under recompute "full" a layer keeps only its input (Megatron's
checkpointing of each layer's input), and the layer being back-propagated holds its full
set once; "selective" drops the tensors of seq x seq size (Korthikanti et al. 2022,
section 5: recompute the attention core only). A stack that fuses each elementwise chain into
one kernel (Transformer Engine, Megatron-Core's fusions) keeps only what the kernel
materializes: ``activation_profile(recomputed=fusion.recomputed_inside(...))``.

Pipeline schedules keep activations of several microbatches at once (``inflight_microbatches``):
GPipe all m; 1F1B p - stage on stage ``stage`` (Narayanan et al. 2021, section 2.2.1);
interleaved 1F1B p + (p - 1 - 2 stage)/v, Megatron-Core's warmup count (on the first stage
Korthikanti et al. 2022's p (1 + (p-1)/(p v)), section 4.2.3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from meshplan.costmodel.kernel_paths import is_float, materializes, value_dtype
from meshplan.graph import OpGraph, OpKind, OpNode
from meshplan.schedules import Schedule
from meshplan.vocabulary import ComputeDtype, Recompute

GIB = 2.0 ** 30
ADAM_MOMENT_BYTES = 8  # two fp32 moments (Kingma & Ba 2015)
SGD_MOMENTUM_BYTES = 4  # one fp32 momentum buffer
MASTER_BYTES = 4  # fp32 master weights under mixed precision (Micikevicius et al. 2018)
GRAD_BYTES = 4  # fp32 gradients / Megatron's fp32 main_grad under mixed precision

# copy_: CopyBackwards keeps no tensor (its input's gradient is the output's, cast back)
_LINEAR_ELEMENTWISE = re.compile(r"aten\.(add|sub|neg|clone|fill|copy_?|zeros_like|ones_like|"
                                 r"eq|ne|lt|le|gt|ge|__and__|__or__|logical_\w+|where|masked_fill|"
                                 r"type_as)\.")  # a cast's backward casts the gradient back
_MUL = re.compile(r"aten\.mul\.")
# data movement whose backward sums or slices the gradient by shape alone (keeps no value)
_SHAPE_ONLY = re.compile(r"aten\.(repeat_interleave|repeat|cat|stack)\.")
# views whose output aliases their input's storage (a saved view costs nothing extra)
_ALIASING = re.compile(r"aten\.(view|_unsafe_view|reshape|transpose|t|permute|split|"
                       r"split_with_sizes|chunk|slice|select|expand|unsqueeze|squeeze|flatten|"
                       r"unflatten|alias|detach|narrow|unbind|movedim|view_as_complex|"
                       r"view_as_real)\.|getitem")


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per parameter of each model-state column, before ZeRO sharding."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def moment_bytes(optimizer: str) -> int:
    """Optimizer state per parameter besides the master weights: Adam's two fp32 moments or
    SGD's momentum buffer."""
    return ADAM_MOMENT_BYTES if optimizer == "adam" else SGD_MOMENTUM_BYTES


def state_bytes_per_param(dtype: str, optimizer: str, *, grad_bytes: float = GRAD_BYTES,
                          master_bytes: float = MASTER_BYTES) -> StateBytes:
    """The table above. Under mixed precision a stack may keep less than Megatron's table:
    ``grad_bytes`` 2 where gradients accumulate and reduce in bf16 (NeMo's recipes,
    ``grad_sync_dtype: bf16``), ``master_bytes`` 2 where the optimizer keeps only the 16 low
    bits of the fp32 master beside the bf16 weights (Apex ``DistributedFusedAdam``
    ``store_param_remainders``: weight and remainder together are the fp32 value)."""
    moments = moment_bytes(optimizer)
    if dtype == ComputeDtype.FP32:
        return StateBytes(weights=4, grads=GRAD_BYTES, optimizer=moments)
    return StateBytes(weights=2, grads=grad_bytes, optimizer=master_bytes + moments)


def model_state_bytes(numel: float, *, dtype: str, optimizer: str, zero: int,
                      dp: int, grad_bytes: float = GRAD_BYTES,
                      master_bytes: float = MASTER_BYTES) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes on one device for ``numel`` local parameters
    (already divided by tensor/pipeline sharding), under ZeRO stage ``zero`` over ``dp``;
    ``grad_bytes`` / ``master_bytes`` as ``state_bytes_per_param``."""
    b = state_bytes_per_param(dtype, optimizer, grad_bytes=grad_bytes, master_bytes=master_bytes)
    d = max(1, dp)
    weights = numel * b.weights / (d if zero >= 3 else 1)
    grads = numel * b.grads / (d if zero >= 2 else 1)
    opt = numel * b.optimizer / (d if zero >= 1 else 1)
    return weights, grads, opt


def optimizer_traffic_s(numel: float, *, dtype: str, optimizer: str, hw,
                        grad_bytes: float = GRAD_BYTES,
                        master_bytes: float = MASTER_BYTES) -> float:
    """Memory-bound time of the optimizer step over ``numel`` parameters on one device: it
    reads and writes every state byte once (2 x ``state_bytes_per_param``, with the
    runtime's gradient and master widths) at the device's large-transfer memory bandwidth.
    Per-tensor kernel costs come on top (costmodel/param_traffic.py)."""
    dev = hw.device
    b = state_bytes_per_param(dtype, optimizer, grad_bytes=grad_bytes, master_bytes=master_bytes)
    return 2 * b.total * numel / (dev.memory_bandwidth_gbps * 1e9 * dev.memory_efficiency(1e9))


def zero3_buffer_bytes(largest_layer_numel: float, *, dtype: str, prefetch: int = 2) -> float:
    """Gathered full weights of the layers in flight under ZeRO-3: the layer computing and
    the one prefetched (torch FSDP's default backward prefetch keeps one layer ahead)."""
    return prefetch * largest_layer_numel * (4 if dtype == ComputeDtype.FP32 else 2)


def grad_sync_buffer_bytes(bucket_bytes: float, local_grad_bytes: float) -> float:
    """Collective buffer of the gradient sync: one bucket (DDP) or the whole flat buffer."""
    return min(bucket_bytes, local_grad_bytes) if bucket_bytes > 0 else 0.0


# -- activations ----------------------------------------------------------------------------

def saved_inputs(node: OpNode, graph: OpGraph) -> tuple[str, ...]:
    """Names of the tensors (producers) this operator's backward reads: none where no input
    needs a gradient (``OpGraph.grad_nodes``)."""
    acts = tuple(i for i in node.inputs if i not in graph.param_map)
    kind = node.kind
    if kind in (OpKind.VIEW, OpKind.CREATION) or node.name not in graph.grad_nodes:
        return ()  # autograd records nothing where no input needs a gradient
    if kind == OpKind.ELEMENTWISE and _MUL.match(node.target):
        # d(a b)/da reads b and d(a b)/db reads a: an input is kept only where another
        # one needs a gradient (x * cos in rotary embeddings keeps cos alone)
        # (y * y names y once in ``inputs``: both factors are y, saved where y needs one)
        needs = [_needs_grad(i, graph) for i in node.inputs]
        squared = sum(a == "%" for a in node.parsed_args()[0]) > len(node.inputs)
        return tuple(i for k, i in enumerate(node.inputs) if i not in graph.param_map
                     and (any(n for j, n in enumerate(needs) if j != k)
                          or squared and needs[k]))
    if kind == OpKind.SOFTMAX:
        return (node.name,)
    if kind == OpKind.ATTENTION:
        return acts[:3] + (node.name,)  # q, k, v and the output (flash keeps logsumexp too)
    if kind == OpKind.REDUCTION and re.search(r"aten\.(sum|mean)\.", node.target):
        return ()
    if kind == OpKind.ELEMENTWISE and _LINEAR_ELEMENTWISE.search(node.target) \
            or _SHAPE_ONLY.match(node.target):
        return ()
    if is_dropout(node):
        if _dropout_p(node) == 0:
            return ()  # eager returns its input and keeps nothing
        return (node.name,)  # the mask, counted at the output's size
    return acts


def is_dropout(node: OpNode) -> bool:
    """A dropout: eager keeps its mask (``saved_inputs``), bool, one byte an element."""
    return node.kind == OpKind.ELEMENTWISE and "dropout" in node.target


def keeps_autocast_copy(node: OpNode, root: str, graph: OpGraph, sizes: dict,
                        autocast_bytes: int, dtype_bytes: int) -> bool:
    """Whether ``node`` keeps its own autocast copy of an input whose storage is ``root``:
    a matmul or attention (autocast's lower-precision ops) reading a float held wider than
    the compute dtype (``activation_profile``; an operator ``sizes`` leaves out, inside a
    compiled block, makes none)."""
    return bool(autocast_bytes) and node.kind in (OpKind.MATMUL, OpKind.ATTENTION) \
        and node.name in sizes and is_float(value_dtype(graph, root)) \
        and sizes.get(root, dtype_bytes) > autocast_bytes


def _dropout_p(node: OpNode) -> float | None:
    """A dropout's probability where the trace gives it as a number, else None."""
    args, kwargs = node.parsed_args()
    p = kwargs.get("p", args[1] if len(args) > 1 else None)
    return float(p) if isinstance(p, (int, float)) else None


def _needs_grad(name: str, graph: OpGraph) -> bool:
    """Whether the value ``name`` carries a gradient (a trainable parameter or downstream of
    one)."""
    info = graph.param_map.get(name)
    if info is not None:
        return info.trainable
    return name in graph.grad_nodes


def alias_root(name: str, graph: OpGraph, *, copies: bool = False) -> str:
    """The tensor whose storage ``name`` shares (through aliasing views). ``copies``: a
    reshape that cannot view its input and copies it (``kernel_paths.materializes``:
    ``repeat_kv``'s keys and values) is a tensor of its own, not an alias."""
    seen = 0
    while name in graph and seen < 64:
        node = graph.node(name)
        if not _ALIASING.search(node.target) or not node.inputs:
            break
        if copies and materializes(graph, name):
            break
        name = node.inputs[0]
        seen += 1
    return name


def tensor_bytes(name: str, graph: OpGraph, dtype_bytes: int, inputs: dict) -> float:
    """Bytes of a tensor in the compute dtype (float tensors) or its own dtype."""
    if name in graph:
        metas = graph.node(name).outputs
    elif name in inputs:
        metas = (inputs[name],)
    else:
        return 0.0
    total = 0.0
    for m in metas:
        per = dtype_bytes if m.dtype in ("float32", "float16", "bfloat16") else \
            (1 if m.dtype == "bool" else 8 if m.dtype == "int64" else 4)
        total += m.numel * per
    return total


def is_seq_squared(name: str, graph: OpGraph, seq_len: int) -> bool:
    if name not in graph or seq_len <= 1:
        return False
    out = graph.node(name).out
    return out is not None and len(out.shape) >= 2 and out.shape[-1] == seq_len \
        and out.shape[-2] == seq_len


@dataclass(frozen=True, slots=True)
class ActivationProfile:
    """Activation bytes of one microbatch on one device, by layer.

    ``kept[layer]``: bytes kept for backward by that layer under no recompute;
    ``kept_selective[layer]``: without seq x seq tensors; ``boundary[layer]``: the layer's
    input (what full recompute keeps), ``boundary[-1]`` the data-independent values all
    blocks share (counted once); layer -1 is everything outside the blocks.
    """

    kept: dict
    kept_selective: dict
    boundary: dict
    kept_matmuls: dict = field(default_factory=dict)
    # what torchtitan's op-level selective AC keeps of a block beside its input: the
    # outputs of its odd parameter matmuls and of its attention kernels (``alternate_matmuls``)
    kept_alternate: dict = field(default_factory=dict)
    # bytes of causal masks (``causal_masks``) among kept / boundary, by layer
    mask_kept: dict = field(default_factory=dict)
    mask_boundary: dict = field(default_factory=dict)
    # the backward's first working set, while every kept tensor is alive (``loss_grad_bytes``)
    loss_working: float = 0.0

    def stage_bytes(self, recompute: str, *, keep_matmuls_only: bool = False,
                    without_masks: bool = False,
                    alternate: bool = False) -> tuple[float, float]:
        """(bytes kept per in-flight microbatch, extra working set of the backward: one
        layer's recompute, or the loss's gradients, ``loss_working``, whichever is larger).

        ``keep_matmuls_only``: selective recompute as the module engine runs it (torchtitan's
        op-level policy, runtime/modules.py ``_SAVED_IN_SELECTIVE``): a block keeps its input
        and its parameter matmuls' outputs (``kept_matmuls``) and recomputes the rest, one
        block at a time in the backward. ``without_masks``: the engine never allocates the
        causal masks the trace made (``causal_masks``). ``alternate`` (with
        ``keep_matmuls_only``): torchtitan's op-level policy, which keeps its attention
        kernels' outputs and every other parameter matmul's (``kept_alternate``) instead."""
        if without_masks and (self.mask_kept or self.mask_boundary):
            return replace(self, kept=_minus(self.kept, self.mask_kept),
                           kept_selective=_minus(self.kept_selective, self.mask_kept),
                           boundary=_minus(self.boundary, self.mask_boundary),
                           mask_kept={}, mask_boundary={}).stage_bytes(
                recompute, keep_matmuls_only=keep_matmuls_only, alternate=alternate)
        if recompute == Recompute.SELECTIVE and keep_matmuls_only:
            saved = self.kept_alternate if alternate else self.kept_matmuls
            kept = sum(self.boundary.values()) + self.kept.get(-1, 0.0) \
                + sum(v for i, v in saved.items() if i >= 0)
            working = max((v - saved.get(i, 0.0) for i, v in self.kept.items()
                           if i >= 0), default=0.0)
            return kept, max(working, self.loss_working)
        if recompute == Recompute.FULL:
            # boundary[-1]: values shared by every block (the mask), kept once
            kept = sum(self.boundary.values()) + self.kept.get(-1, 0.0)
            working = max((v for i, v in self.kept.items() if i >= 0), default=0.0)
            return kept, max(working, self.loss_working)
        table = self.kept_selective if recompute == Recompute.SELECTIVE else self.kept
        return sum(table.values()), self.loss_working


def loss_grad_bytes(node: OpNode, graph: OpGraph, dtype_bytes: int, inputs: dict) -> float:
    """Gradients a loss operator's backward holds at once, the first step of the backward,
    while every kept activation is still alive: cross entropy (log-softmax then NLL, as
    eager autograd runs ``aten.cross_entropy_loss``) the gradient of the log-probabilities
    and the one of the logits it writes from it, two tensors of the logits' size; another
    loss the gradient of its input. Measured with runtime/memory_probe.py on a Llama in
    fp32 (tests/test_costmodel_engine.py): the step's peak is at ``_log_softmax_backward_data``."""
    if node.kind != OpKind.LOSS or not node.inputs:
        return 0.0
    copies = 2 if "cross_entropy" in node.target else 1
    return copies * tensor_bytes(alias_root(node.inputs[0], graph), graph, dtype_bytes, inputs)


def _minus(table: dict, sub: dict) -> dict:
    return {k: max(0.0, v - sub.get(k, 0.0)) for k, v in table.items()}


def causal_masks(graph: OpGraph) -> set[str]:
    """Square boolean values that depend on no input and that attention reads as its
    mask (its fourth input): the causal mask a Hugging Face model builds when it is exported. Run eagerly
    with SDPA and no padding mask, transformers 5.x builds none and calls SDPA with
    ``is_causal=True`` (``masking_utils._ignore_causal_mask_sdpa`` returns True unless
    exporting or the padding mask is traced), so the module engine never allocates them."""
    out = set()
    for node in graph.nodes:
        if node.kind != OpKind.ATTENTION or len(node.inputs) < 4:
            continue
        root = alias_root(node.inputs[3], graph)
        out_meta = graph.node(root).out if root in graph else None
        if out_meta is not None and root not in graph.data_nodes and out_meta.dtype == "bool" \
                and len(out_meta.shape) >= 2 and out_meta.shape[-1] == out_meta.shape[-2] \
                and not _built_window(graph, root, out_meta.shape[-1]):
            out.add(root)
    return out


def _built_window(graph: OpGraph, root: str, kv_len: int) -> bool:
    """Whether the mask ``root`` is a sliding-window band that eager transformers builds:
    its chain compares positions against ``index - window`` (``gt``), and the keys are at
    least ``window`` long (``masking_utils._ignore_causal_mask_sdpa`` keeps the mask then;
    shorter, the band is the causal pattern and no mask is built). A band whose window the
    trace does not show is taken as built."""
    seen, stack = set(), [root]
    while stack:
        name = stack.pop()
        if name in seen or name not in graph or name in graph.data_nodes:
            continue
        seen.add(name)
        node = graph.node(name)
        if node.target.startswith(("aten.gt.", "aten.lt.", "aten.ge.")):
            window = None
            for i in node.inputs:
                if i in graph and graph.node(i).target.startswith("aten.sub."):
                    consts = [a for a in graph.node(i).parsed_args()[0]
                              if isinstance(a, int) and not isinstance(a, bool)]
                    window = consts[0] if consts else None
            if window is None or kv_len >= window:
                return True
        stack.extend(node.inputs)
    return False


_BUILDERS: dict = {}


def mask_builders(graph: OpGraph) -> frozenset[str]:
    """The causal masks (``causal_masks``) and every operator that only they need: the
    data-independent operators whose values only mask builders read (the position indices,
    comparisons and ``and``s a Hugging Face export builds a (batch, 1, seq, seq) mask with),
    and the key / value repeats of an attention that reads such a mask: transformers' SDPA
    path repeats them (``repeat_kv``, a copy: ``kernel_paths.materializes``) only when it
    passes a mask, and with none calls SDPA with ``enable_gqa=True``
    (transformers/integrations/sdpa_attention.py ``use_gqa_in_sdpa``). An engine that runs
    the user's modules eagerly builds none of them (``RuntimeModel.causal_mask_skipped``),
    so none is priced there."""
    hit = _BUILDERS.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    masks = causal_masks(graph)
    out = set(masks)
    for node in graph.nodes:
        if node.kind != OpKind.ATTENTION or len(node.inputs) < 4 \
                or alias_root(node.inputs[3], graph) not in masks:
            continue
        key = graph.node(node.inputs[1]).out if node.inputs[1] in graph else None
        if key is None or not key.shape or key.shape[-1] > 256:
            continue  # enable_gqa needs head dims of at most 256 (use_gqa_in_sdpa)
        for name in node.inputs[1:3]:  # key, value: through views to the repeat's copy
            for _ in range(16):
                if name not in graph or graph.node(name).kind != OpKind.VIEW:
                    break
                if materializes(graph, name):
                    out.add(name)
                    break
                name = graph.node(name).inputs[0] if graph.node(name).inputs else ""
    if out:
        users = graph.users
        for node in reversed(graph.nodes):  # readers before producers
            name = node.name
            if name in out or name in graph.data_nodes:
                continue
            readers = users.get(name, ())
            if readers and all(u in out for u in readers):
                out.add(name)
    if len(_BUILDERS) > 32:
        _BUILDERS.clear()
    _BUILDERS[id(graph)] = (graph, frozenset(out))
    return frozenset(out)


def activation_profile(graph: OpGraph, nodes, *, split_of, dtype_bytes: int, seq_len: int,
                       micro_fraction: float, attention_extra_per_node: float = 0.0,
                       recomputed: dict | None = None, sizes: dict | None = None,
                       autocast_bytes: int = 0, read_split=None) -> ActivationProfile:
    """Saved-for-backward bytes per layer for the operators ``nodes`` (names).

    ``split_of(name)`` gives how many devices split that tensor; ``micro_fraction`` scales
    the traced global batch to one microbatch; ``attention_extra_per_node`` adds tensors an
    attention kernel keeps beyond its inputs (e.g. the probabilities of math attention);
    ``recomputed`` maps a tensor that a fused kernel rebuilds in its backward to the tensors
    kept in its place (``fusion.recomputed_inside``: the stack fuses its elementwise chains).

    Engines that run the model with eager autograd (``RuntimeModel.eager_activations``)
    keep what eager PyTorch keeps, at the dtypes it holds them in:
    - ``sizes``: bytes per element of each value (``eager.element_bytes``: autocast's fp32
      residual stream, the fp32 chain inside an RMSNorm, ``x.float()``), not the compute
      dtype's for every float (a value it leaves out, in ``dtype_bytes``; an operator it
      leaves out makes no autocast copy: the compiled blocks);
    - ``autocast_bytes`` (the compute dtype's bytes under ``torch.autocast``, else 0): a
      matmul or attention keeps its own lower-precision copy of each input held wider
      (autocast casts an activation at every use), split as the operator reads it
      (``read_split(name, k)``: a sequence-parallel input gathered for the matmul is cast
      whole);
    - (autocast's cast copies of the weights, one per forward, are the bf16 weights of
      the model-state table: fp32 weights are the master copy there);
    - a reshape that copies (``kernel_paths.materializes``: ``repeat_kv``) is a tensor of
      its own, except the key / value repeats of a mask-reading attention
      (``mask_builders``), which count as masks: an engine that builds no mask calls SDPA
      with ``enable_gqa`` and keeps the unrepeated tensor;
    - the loss reads logits the engine upcast to fp32 (runtime/modules.py ``_loss``,
      runtime/graph/parallelize.py): its kept log-probabilities and its gradients are fp32.
    Measured on this CPU with saved-tensor hooks and the step memory probe
    (tests/test_costmodel_engine.py).
    """
    inputs = dict(graph.inputs)
    eager = sizes is not None
    builders = mask_builders(graph) if eager else frozenset()

    def nbytes(name: str, per: int | None = None) -> float:
        if per is None:
            per = sizes.get(name, dtype_bytes) if eager else dtype_bytes
        return tensor_bytes(name, graph, per, inputs)

    def root_of(name: str) -> str:
        return alias_root(name, graph, copies=eager)
    kept: dict[int, float] = {}
    selective: dict[int, float] = {}
    boundary: dict[int, float] = {}
    matmuls: dict[int, float] = {}  # outputs of parameter matmuls among the kept tensors
    alternate: dict[int, float] = {}  # torchtitan's op-level selective AC (kept_alternate)
    recomputed_mm = alternate_matmuls(graph)
    masks = causal_masks(graph)
    mask_kept: dict[int, float] = {}
    mask_boundary: dict[int, float] = {}
    seen: set[str] = set()
    loss_working = 0.0
    for name in nodes:
        node = graph.node(name)
        layer = node.layer
        if node.kind == OpKind.LOSS:
            src = alias_root(node.inputs[0], graph) if node.inputs else name
            loss_working = max(loss_working, loss_grad_bytes(
                node, graph, 4 if eager else dtype_bytes, inputs)
                * micro_fraction / max(1, split_of(src)))
        for t in saved_inputs(node, graph):
            if not eager:
                for root in _kept_for(alias_root(t, graph), recomputed):
                    if root in seen:
                        continue
                    seen.add(root)
                    b = nbytes(root) * micro_fraction / max(1, split_of(root))
                    kept[layer] = kept.get(layer, 0.0) + b
                    if root in masks:
                        mask_kept[layer] = mask_kept.get(layer, 0.0) + b
                    if not is_seq_squared(root, graph, seq_len):
                        selective[layer] = selective.get(layer, 0.0) + b
                continue
            root, cast = root_of(t), False
            if node.kind == OpKind.LOSS and t == node.inputs[0]:
                key, of, per = ("loss", name), root, 4  # fp32 log-probabilities
            elif is_dropout(node):
                key, of, per = ("mask", name), root, 1  # the mask eager keeps is bool
            elif keeps_autocast_copy(node, root, graph, sizes, autocast_bytes, dtype_bytes):
                key, of, per, cast = ("cast", name, t), t, autocast_bytes, True  # its copy
            else:
                key, of, per = root, root, None
            if key in seen:
                continue
            seen.add(key)
            split = split_of(root)
            if cast and read_split is not None:
                split = read_split(name, node.inputs.index(t))
            b = nbytes(of, per) * micro_fraction / max(1, split)
            extra = 0.0
            if root in builders and root not in masks:
                # a key / value repeat only an engine that builds the mask makes: the
                # unrepeated tensor (or its cast) is kept, the excess counts as mask
                base = alias_root(root, graph)
                base_key = ("cast", name, base) if cast else base
                one = 0.0 if base_key in seen else \
                    nbytes(base, per) * micro_fraction / max(1, split_of(base))
                seen.add(base_key)
                b, extra = one, max(0.0, b - one)
            kept[layer] = kept.get(layer, 0.0) + b + extra
            if root in masks or extra:
                mask_kept[layer] = mask_kept.get(layer, 0.0) + (b if root in masks else extra)
            if not is_seq_squared(root, graph, seq_len):
                selective[layer] = selective.get(layer, 0.0) + b + extra
        if layer >= 0 and _is_param_matmul(name, graph):
            # selective checkpointing stores every such output in the forward, whether
            # the backward reads it or not (the recompute reuses it)
            matmuls[layer] = matmuls.get(layer, 0.0) + tensor_bytes(
                name, graph, dtype_bytes, inputs) * micro_fraction / max(1, split_of(name))
            if name not in recomputed_mm:
                alternate[layer] = alternate.get(layer, 0.0) + tensor_bytes(
                    name, graph, dtype_bytes, inputs) * micro_fraction / max(1, split_of(name))
        if layer >= 0 and node.kind == OpKind.ATTENTION:
            # SDPA's outputs: the attention output and its fp32 logsumexp (one per query row)
            out = tensor_bytes(name, graph, dtype_bytes, inputs)
            meta = node.out
            lse = meta.numel / meta.shape[-1] * 4 if meta is not None and meta.shape else 0.0
            alternate[layer] = alternate.get(layer, 0.0) + (out + lse) * micro_fraction \
                / max(1, split_of(name))
        if node.kind == OpKind.ATTENTION and attention_extra_per_node:
            kept[layer] = kept.get(layer, 0.0) + attention_extra_per_node
        if layer >= 0:
            for t in node.inputs:
                root = root_of(t)
                if root not in graph or graph.node(root).layer == layer \
                        or graph.node(root).kind == OpKind.CREATION:
                    continue
                # a value that depends on no input or parameter (the causal mask, positions)
                # is one tensor every block reads: held once per stage, made here or rebuilt
                # (DECISIONS 15), not once per block; the stage's input counts though it was
                # received from the previous stage
                at = layer if root in graph.data_nodes else -1
                if ("b", at, root) in seen:
                    continue
                seen.add(("b", at, root))
                b = nbytes(root) * micro_fraction / max(1, split_of(root))
                boundary[at] = boundary.get(at, 0.0) + b
                if root in masks:
                    mask_boundary[at] = mask_boundary.get(at, 0.0) + b
    return ActivationProfile(kept, selective, boundary, matmuls, alternate, mask_kept,
                             mask_boundary, loss_working)


def _kept_for(root: str, recomputed: dict | None) -> tuple[str, ...]:
    """The tensors kept so that ``root`` is available in the backward: itself, or where a
    fused kernel rebuilds it, the materialized tensors it is rebuilt from."""
    if recomputed and root in recomputed:
        return recomputed[root]
    return (root,)


def _is_param_matmul(name: str, graph: OpGraph) -> bool:
    """An output of a matmul with a weight (linear, addmm, mm): what the module engine's
    selective recompute saves."""
    if name not in graph:
        return False
    node = graph.node(name)
    return node.kind == OpKind.MATMUL and any(i in graph.param_map for i in node.inputs)


def alternate_matmuls(graph: OpGraph) -> frozenset[str]:
    """The block parameter matmuls torchtitan's op-level selective activation checkpointing
    recomputes: its policy (torchtitan ``_apply_op_sac``, as of 9dec370, the commit
    benchmarks/h100_validation.py prices) counts ``aten.mm`` calls per checkpointed block
    and saves every call's output but the 2nd, 4th, ... one's, with SDPA's outputs;
    everything else it recomputes. In a Llama block (q, k, v, o, gate, up, down) that
    recomputes k, o and up. A matmul with a bias reaches the policy as ``aten.addmm``
    (GPT-2's Conv1D calls it; ATen's ``linear`` takes it for a biased 2-D or contiguous 3-D
    input), which is neither counted nor in that save list: recomputed (``_counts_as_mm``).
    One walk per graph: every operator pass of a search asks for the same set."""
    hit = _ALTERNATE.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    count: dict[int, int] = {}
    out = set()
    for node in graph.nodes:
        if node.layer < 0 or not _is_param_matmul(node.name, graph):
            continue
        if not _counts_as_mm(node):
            out.add(node.name)
            continue
        count[node.layer] = count.get(node.layer, 0) + 1
        if count[node.layer] % 2 == 0:
            out.add(node.name)
    if len(_ALTERNATE) >= 64:
        _ALTERNATE.clear()
    _ALTERNATE[id(graph)] = (graph, frozenset(out))
    return _ALTERNATE[id(graph)][1]


# id(graph) -> (graph, alternate_matmuls(graph)); the graph is held so its id is not reused
_ALTERNATE: dict = {}


def _counts_as_mm(node) -> bool:
    """A parameter matmul that dispatches ``aten.mm`` under the checkpoint's dispatch mode:
    ``mm``, ``matmul`` of a 2-D weight, ``linear`` without a bias (ATen's ``linear`` ->
    ``matmul`` -> ``mm``); not ``addmm`` (a bias), ``bmm``, ``baddbmm`` or ``einsum``."""
    op = node.target.split(".")[1] if node.target.startswith("aten.") else ""
    if op == "linear":
        return len(node.inputs) < 3  # (input, weight[, bias])
    return op in ("mm", "matmul")


def inflight_microbatches(schedule: str, stage: int, num_stages: int, microbatches: int,
                          virtual_stages: int = 1) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak (see module doc)."""
    m, p, v = microbatches, num_stages, virtual_stages
    if schedule == Schedule.GPIPE or p == 1:
        return float(m) if p > 1 else 1.0
    if schedule == Schedule.INTERLEAVED and v > 1:
        # Megatron-Core's interleaved 1F1B (pipeline_parallel/schedules.py
        # get_pp_rank_microbatches): rank r runs 2 (p - r - 1) + (v - 1) p warmup forwards
        # of model chunks (microbatch groups of p), then one more before each backward, so
        # it holds that many chunk activations plus one, each 1/v of its stage's; rank 0:
        # p + (p - 1) / v, Korthikanti et al.'s amplification, and every rank about p
        chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
        return chunks / v
    return float(min(p - stage, m))


def activation_memory(per_microbatch_bytes: float, working_bytes: float, *, schedule: str,
                      stage: int, num_stages: int, microbatches: int,
                      virtual_stages: int = 1) -> float:
    """Peak activation bytes of a stage: in-flight microbatches x kept bytes, plus the
    working set of one layer's recomputed backward."""
    return per_microbatch_bytes * inflight_microbatches(
        schedule, stage, num_stages, microbatches, virtual_stages) + working_bytes
