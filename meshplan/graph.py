"""The operator graph (OpGraph): the planner's IR, built once by ``trace`` and then read-only.

trace -> **OpGraph** -> cost -> solve -> run. Nodes are aten operators of the exported
training graph, in topological order; every record is a frozen dataclass so passes cannot
change it behind each other's back.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property, lru_cache


class OpKind(StrEnum):
    """Closed set of operator classes; the cost model and the strategy rules key on it."""

    MATMUL = "matmul"  # mm, bmm, addmm, linear, matmul, einsum, baddbmm
    ATTENTION = "attention"  # scaled_dot_product_attention and its fused variants
    EMBEDDING = "embedding"
    NORM = "norm"  # layer_norm, rms_norm, group_norm
    SOFTMAX = "softmax"
    ELEMENTWISE = "elementwise"  # pointwise math, activations, dropout
    REDUCTION = "reduction"  # sum, mean, amax, ...
    VIEW = "view"  # view/reshape/transpose/permute/split/cat/slice/expand: no arithmetic
    LOSS = "loss"  # cross_entropy / nll_loss
    CREATION = "creation"  # arange, zeros, full: no tensor inputs
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A parameter or buffer the graph reads. ``name`` is its fully qualified module path."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool = True
    tied_to: str | None = None  # the first name of a shared (tied) parameter

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@lru_cache(maxsize=1 << 16)
def _literal_args(args_repr: str) -> tuple[list, dict]:
    """``args_repr`` parsed once per distinct string: the planners read the arguments of every
    operator of every repeated block many times (the pipeline search walks the graph once
    per tensor-parallel layout), and blocks repeat the same strings."""
    try:
        args, kwargs = ast.literal_eval(args_repr)
        return list(args), dict(kwargs)
    except (ValueError, SyntaxError, TypeError):
        return [], {}


@dataclass(frozen=True, slots=True)
class OpNode:
    """One operator of the forward graph.

    ``inputs`` names the producing nodes (graph inputs and parameters are nodes too, of
    kind ``placeholder``); ``arg_kinds`` says for each input whether it is a parameter,
    a graph input or an activation. FLOPs are forward FLOPs from torch.utils.flop_counter.
    """

    name: str
    target: str  # e.g. "aten.mm.default", "placeholder", "output"
    kind: OpKind
    inputs: tuple[str, ...]
    outputs: tuple[TensorMeta, ...]
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    params: tuple[str, ...] = ()  # fully qualified names of parameters this op reads
    module_path: str = ""
    layer: int = -1  # index of the repeated block this op belongs to, -1 outside blocks
    source: str = ""  # "file.py:123" of the user's code that made this op
    args_repr: str = ""  # the non-tensor arguments, for the strategy rules (dims, shapes)

    @property
    def out(self) -> TensorMeta | None:
        return self.outputs[0] if self.outputs else None

    def parsed_args(self) -> tuple[list, dict]:
        """The call's arguments read back from ``args_repr`` (tensors appear as "%");
        ([], {}) when they do not parse."""
        args, kwargs = _literal_args(self.args_repr)
        return list(args), dict(kwargs)


@dataclass(frozen=True, slots=True)
class CallSignature:
    """How the flat graph inputs (``inputs_0``, ``inputs_1``, ...) map back to one call of the
    model and its loss: ``num_args`` positional arguments, then the keyword arguments named
    ``kwarg_names`` (in that order), then ``num_targets`` loss targets."""

    num_args: int
    kwarg_names: tuple[str, ...] = ()
    num_targets: int = 0

    def __post_init__(self):
        if self.num_args < 0 or self.num_targets < 0:
            raise ValueError(f"negative counts in {self}")

    @property
    def size(self) -> int:
        return self.num_args + len(self.kwarg_names) + self.num_targets

    def roles(self) -> tuple[tuple[str, str], ...]:
        """(role, key) of every flat input: ("arg", "0"), ("kwarg", "attention_mask"),
        ("target", "0")."""
        return (tuple(("arg", str(i)) for i in range(self.num_args))
                + tuple(("kwarg", k) for k in self.kwarg_names)
                + tuple(("target", str(i)) for i in range(self.num_targets)))


@dataclass(frozen=True)
class OpGraph:
    """The traced model. ``nodes`` are call_function nodes in topological order."""

    nodes: tuple[OpNode, ...]
    params: tuple[ParamInfo, ...]
    inputs: tuple[tuple[str, TensorMeta], ...]  # graph inputs in call order
    output: str  # name of the node producing the loss (or the model output)
    layer_fingerprints: tuple[str, ...]  # one structural fingerprint per layer index
    block_module: str = ""  # module path prefix of the repeated blocks, e.g. "m.transformer.h"
    model_name: str = ""
    signature: CallSignature | None = None  # None: every input is a positional model argument
    loss: str = ""  # the loss traced with the model, as tracing.loss_label names it
    # the graph this one was cut from (the pipeline search's neighbourhoods,
    # planner/stagecost.py), whose per-operator analyses hold for the cut's operators
    whole: "OpGraph | None" = field(default=None, compare=False, repr=False)
    _index: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_index", {n.name: i for i, n in enumerate(self.nodes)})

    # -- lookups ---------------------------------------------------------------------
    def node(self, name: str) -> OpNode:
        return self.nodes[self._index[name]]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def position(self, name: str) -> int:
        return self._index[name]

    @cached_property
    def param_map(self) -> dict[str, ParamInfo]:
        return {p.name: p for p in self.params}

    @cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                if i in out:
                    out[i].append(n.name)
        return {k: tuple(v) for k, v in out.items()}

    # -- model-level facts ------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_fingerprints)

    @property
    def layers_identical(self) -> bool:
        return len(set(self.layer_fingerprints)) <= 1

    @cached_property
    def param_count(self) -> int:
        """Exact count of trainable parameters, tied parameters counted once."""
        return sum(p.numel for p in self.params if p.trainable and p.tied_to is None)

    @cached_property
    def forward_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    @cached_property
    def grad_nodes(self) -> frozenset[str]:
        """Floating-point (or complex) operators downstream of a trainable parameter (they carry
        grads)."""
        out: set[str] = set()
        trainable = {p.name for p in self.params if p.trainable}
        for n in self.nodes:
            if any(i in trainable or i in out for i in n.inputs) and n.kind != OpKind.CREATION:
                if any(o.dtype.startswith(("float", "bfloat", "complex")) for o in n.outputs):
                    out.add(n.name)
        return frozenset(out)

    @cached_property
    def data_nodes(self) -> frozenset[str]:
        """Graph inputs, parameters and every operator whose value depends on one of them."""
        out: set[str] = {name for name, _ in self.inputs} | {p.name for p in self.params}
        for n in self.nodes:
            if any(i in out for i in n.inputs):
                out.add(n.name)
        return frozenset(out)

    @property
    def train_flops(self) -> int:
        """Forward + backward FLOPs of one step without recompute (backward = 2x forward)."""
        return 3 * self.forward_flops

    def layer_nodes(self, layer: int) -> tuple[OpNode, ...]:
        return tuple(n for n in self.nodes if n.layer == layer)

    @cached_property
    def fingerprint(self) -> str:
        """Hash of the graph's structure and shapes: a plan refuses to run on another model."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(json.dumps([n.target, n.inputs, [(o.shape, o.dtype) for o in n.outputs],
                                 n.args_repr], sort_keys=True).encode())
        for p in self.params:
            h.update(json.dumps([p.name, p.shape, p.dtype]).encode())
        for name, meta in self.inputs:
            h.update(json.dumps([name, meta.shape, meta.dtype]).encode())
        return "sha256:" + h.hexdigest()[:32]


_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES.get(dtype, 4)
