"""torch.export of a model's training step (forward + loss) on fake tensors, cached per
model and call, and the one-line explanation when the export fails.

trace -> cost -> solve -> run. The export half of ``meshplan.tracing`` (whose docstring
describes both halves and whose ``trace`` is the entry): meshplan/export_graph.py builds
the OpGraph from what this module exports, meshplan/repeat_trace.py exports three blocks of
a long stack with it. Split from meshplan/tracing.py so that those import no module above
them (issue 40).
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import os
import re
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import meshplan.errors
from meshplan.errors import TraceError
from meshplan.graph import CallSignature


class LossError(TraceError):
    """``loss_fn`` did not return one scalar tensor."""

LossFn = Callable[..., torch.Tensor]


def next_token_loss(output: torch.Tensor, ids: torch.Tensor, *rest) -> torch.Tensor:
    """Language-model loss on synthetic data: predict token t+1 from tokens <= t."""
    vocab = output.shape[-1]
    return F.cross_entropy(output[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))


def target_loss(output: torch.Tensor, target: torch.Tensor, *rest) -> torch.Tensor:
    """The default loss when targets are given without a loss_fn: cross entropy of the last
    output dim against the targets (class labels, or one label per token)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


Inputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def flatten_call(inputs: Inputs, targets: torch.Tensor | Sequence[torch.Tensor] = ()
                 ) -> tuple[tuple[torch.Tensor, ...], CallSignature]:
    """The model's inputs (a tensor, a tuple of positional arguments or a dict of keyword
    arguments) and the loss targets as one flat tuple, with the signature that undoes it."""
    targets = (targets,) if isinstance(targets, torch.Tensor) else tuple(targets or ())
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, Sequence):
        args, kwargs = tuple(inputs), {}
    else:
        raise TraceError(f"inputs of type {type(inputs).__name__} are not supported; pass a "
                         "tensor, a tuple of tensors (positional arguments) or a dict of "
                         "tensors (keyword arguments)")
    flat = (*args, *kwargs.values(), *targets)
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"input {i} is a {type(x).__name__}; every model input and "
                             "target must be a tensor (bind other arguments in the model or "
                             "a wrapper module)")
    return flat, CallSignature(len(args), tuple(kwargs), len(targets))


def unflatten_call(flat: Sequence, sig: CallSignature) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, targets) from the flat inputs, as ``flatten_call`` made them."""
    if len(flat) != sig.size:
        raise TraceError(f"got {len(flat)} flat inputs for a call with {sig.size}")
    k = sig.num_args + len(sig.kwarg_names)
    return (tuple(flat[:sig.num_args]), dict(zip(sig.kwarg_names, flat[sig.num_args:k])),
            tuple(flat[k:]))


def model_output(out):
    """What a loss reads from a model's output: ``.logits`` of a transformers output, the
    first element of a tuple, or the tensor itself."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


class TrainingModule(nn.Module):
    """model + loss as one module: forward(*flat inputs) -> scalar loss.

    The flat inputs are the model's positional arguments, its keyword arguments and the
    loss targets (``CallSignature``). The loss is ``loss_fn(outputs, *targets)``; without a
    loss_fn it is ``target_loss`` when targets are given and ``next_token_loss`` on the
    first input otherwise (the language-model default). HF transformers models are called
    with ``use_cache=False`` and their ``.logits`` taken; an encoder-decoder model called
    with token ids alone gets the same ids as decoder input (synthetic sequence-to-sequence).
    With ``loss=False`` forward returns the model's outputs instead (eval).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None = None,
                 signature: CallSignature | None = None, *, loss: bool = True):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.signature = signature
        self.with_loss = loss
        params = inspect.signature(model.forward).parameters
        self._kwargs = {"use_cache": False} if "use_cache" in params else {}
        config = getattr(model, "config", None)
        self._seq2seq = bool(getattr(config, "is_encoder_decoder", False))

    def forward(self, *inputs):
        sig = self.signature or CallSignature(len(inputs))
        args, kwargs, targets = unflatten_call(inputs, sig)
        if self._seq2seq and len(args) == 1 and not kwargs:
            out = self.model(input_ids=args[0], decoder_input_ids=args[0], **self._kwargs)
        else:
            out = self.model(*args, **kwargs, **self._kwargs)
        out = model_output(out)
        if not self.with_loss:
            return out
        if self.loss_fn is not None:
            loss = self.loss_fn(out, *targets)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
                    else f"a {type(loss).__name__}"
                raise LossError(f"loss_fn returned {what}, not a scalar tensor; reduce it "
                                "(e.g. .mean(), or reduction='mean') so that one number is "
                                "differentiated")
            return loss
        if targets:
            return target_loss(out, *targets)
        first = args[0] if args else next(iter(kwargs.values()))
        return next_token_loss(out, first)


WRAPPER_PREFIX = "model."


TRACE_DEVICE = "cpu"  # the device meta models are traced for: the runtime's (gloo on CPU)


def export_training_graph(model: nn.Module, example_inputs: Inputs,
                          loss_fn: LossFn | None = None, *, example_targets=(),
                          signature: CallSignature | None = None, loss: bool = True,
                          device: str = TRACE_DEVICE) -> torch.export.ExportedProgram:
    """Export model + loss with torch.export (non-strict). Raises TraceError naming the op.

    ``example_inputs`` is a tensor, a tuple (positional arguments) or a dict (keyword
    arguments); ``example_targets`` go only to the loss. ``signature`` says that
    ``example_inputs`` is already flat (as ``flatten_call`` made it). A model or inputs on
    the meta device are traced as fake tensors on ``device`` (``on_device``), so the graph
    takes the branches the model takes there; nothing is allocated either way."""
    if signature is None:
        flat, signature = flatten_call(example_inputs, example_targets)
    else:
        flat = tuple(example_inputs)
    flat = _distinct(flat)
    cache_key = _trace_key(model, flat, loss_fn, signature, loss, device)
    if cache_key is not None and cache_key in _TRACES:
        _TRACES.move_to_end(cache_key)
        return _TRACES[cache_key]
    wrapped = TrainingModule(model, loss_fn, signature, loss=loss)
    try:
        with _quiet_fake_tensor_log(), on_device(model, flat, device) as (fake_flat, originals):
            ep = torch.export.export(wrapped, fake_flat, strict=False)
            # the program keeps the model's own (meta) tensors, not the fakes
            for table in (ep.state_dict, ep.constants):
                for key, t in table.items():
                    table[key] = originals.get(id(t), t)
    except LossError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear TraceError
        cause = exc
        while cause is not None and not isinstance(cause, LossError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # the loss, not the model's traceability
            raise LossError(str(cause)) from None
        raise TraceError(_explain_trace_failure(exc, model, flat)) from exc
    if cache_key is not None:
        _TRACES[cache_key] = ep
        while len(_TRACES) > _TRACES_KEPT:
            _TRACES.popitem(last=False)
    return ep


def _distinct(flat: tuple) -> tuple:
    """``flat`` with a tensor passed twice (ids as input and as target) cloned: one tensor
    would be one placeholder used twice in the export, a graph unlike the one every later
    call (distinct tensors) makes."""
    seen: set[int] = set()
    return tuple(x.clone() if id(x) in seen or seen.add(id(x)) else x for x in flat)


# Exports of meta models by what determines them (_trace_key). The planner, the engine
# check and the runtime each export the same model at the same shapes; a non-strict export
# costs 1-3 s even for a 2-layer model, and a 4-process test launch made 24 of them per rank
# (DECISIONS 64). Module-level state (an exception to STYLE 3, DECISIONS 64): the callers are
# the public API's functions, which have no object to hold it. An ExportedProgram is not
# changed by its users (runtime/graph/programs.runnable_graph_module copies the subgraphs it
# rewrites); its state_dict holds meta tensors of the model first exported, which nobody
# reads for values (graph_from_export takes names and ties from the model passed to it).
# 32: a sweep of one model over many meshes and batch sizes stays within it.
_TRACES: "OrderedDict[tuple, torch.export.ExportedProgram]" = OrderedDict()
_TRACES_KEPT = 32


def _trace_key(model: nn.Module, flat: tuple, loss_fn, signature, loss: bool,
               device: str) -> tuple | None:
    """What a meta model's export depends on, or None where that cannot be told (real
    tensors, hooks, an attribute of a kind not listed in ``_frozen``, an unhashable loss):
    the module tree (types, training flags, every attribute's value), every tensor's full
    name, kind, shape, stride, dtype and ties, every HF config (its JSON and attention
    implementation), the inputs' shapes, the loss function object, the call signature and
    torch's grad and autocast modes."""
    if not all(isinstance(x, torch.Tensor) and x.is_meta for x in flat) or \
            torch.nn.modules.module._global_forward_hooks or \
            torch.nn.modules.module._global_forward_pre_hooks:
        return None
    ties: dict[int, int] = {}
    configs: dict[int, object] = {}
    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or \
                m._backward_pre_hooks or m._state_dict_hooks or "forward" in vars(m):
            return None
        attrs = []
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules") or k in _UNTRACED_ATTRS or \
                    isinstance(v, nn.Module):
                continue
            if hasattr(v, "to_json_string") and hasattr(v, "_attn_implementation"):
                configs.setdefault(id(v), v)  # an HF config: keyed once, below
                continue
            frozen = _frozen(v, ties)
            if frozen is _UNKNOWN:
                return None
            attrs.append((k, frozen))
        tensors = tuple((kind, key, _frozen(t, ties), getattr(m, "_non_persistent_buffers_set",
                                                               set()).__contains__(key))
                        for kind, table in (("param", m._parameters), ("buffer", m._buffers))
                        for key, t in table.items() if t is not None)
        if any(t[2] is _UNKNOWN for t in tensors):
            return None
        modules.append((name, type(m), tuple(attrs), tensors))
    try:
        config = tuple((c.to_json_string(use_diff=False), c._attn_implementation,
                        getattr(c, "_experts_implementation", None)) for c in configs.values())
    except Exception:  # noqa: BLE001 - a config that cannot be written: not cached
        return None
    inputs = tuple((tuple(x.shape), x.stride(), x.dtype, x.requires_grad) for x in flat)
    modes = (torch.is_grad_enabled(), torch.get_default_dtype(),
             torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    key = (tuple(modules), config, inputs, loss_fn, signature, loss, device, modes)
    try:
        hash(key)
    except TypeError:
        return None
    return key


_UNKNOWN = object()
# Bookkeeping no forward reads: Hugging Face marks modules whose weights it initialized
# (``_is_hf_initialized``), which a model built on CPU has and its meta copy, built on meta
# for the planner, has not. Keying it kept the runtime's export from reusing the planner's.
_UNTRACED_ATTRS = frozenset({"_is_hf_initialized"})


def _frozen(v, ties: dict[int, int]):
    """A hashable stand-in for an attribute value that tells every value that could trace
    differently apart (its type included: 1 and 1.0 differ), or _UNKNOWN."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        if not v.is_meta:
            return _UNKNOWN  # real values a trace may read (or lift as a constant)
        return (type(v), tuple(v.shape), v.stride(), v.dtype, v.requires_grad,
                ties.setdefault(id(v), len(ties)))
    if isinstance(v, (tuple, list, frozenset, set)):
        items = [_frozen(x, ties) for x in (sorted(v, key=repr) if isinstance(v, (set, frozenset))
                                            else v)]
        return _UNKNOWN if any(x is _UNKNOWN for x in items) else (type(v), tuple(items))
    if isinstance(v, dict):
        items = [(k, _frozen(x, ties)) for k, x in v.items()]
        if any(x is _UNKNOWN for _, x in items):
            return _UNKNOWN
        return (dict, tuple(items))
    if inspect.isfunction(v) or inspect.isbuiltin(v):
        return (type(v), getattr(v, "__module__", None), v.__qualname__)
    if isinstance(v, enum.Enum):
        return (type(v), v.value)
    if callable(getattr(v, "to_json_string", None)):  # HF's GenerationConfig and kin
        try:
            return (type(v), v.to_json_string())
        except Exception:  # noqa: BLE001 - one that cannot be written is not told apart
            return _UNKNOWN
    return _UNKNOWN


@contextlib.contextmanager
def on_device(model: nn.Module, flat: tuple[torch.Tensor, ...], device: str):
    """Meta tensors (the model's and the inputs) as fake tensors on ``device`` while the
    block runs; yields the inputs to trace with and {id(fake): original tensor}, and puts
    the model's own tensors back.

    Models branch on their tensors' device: transformers' MoE routing runs ``histc`` on int32
    on any device but CPU, which CPU then cannot run (``"histogram_cpu" not implemented for
    'Int'``). A fake tensor on CPU takes the CPU branch and allocates nothing; export adopts
    the fake mode of its inputs. Private torch API: torch._subclasses.FakeTensorMode."""
    tensors = [t for _, t in _module_tensors(model)] + list(flat)
    if not any(t.is_meta for t in tensors):
        yield flat, {}
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    memo: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:  # tied parameters stay one tensor
            if t.is_meta:
                with mode:
                    f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            else:
                f = mode.from_tensor(t)
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else f
            originals[id(memo[id(t)])] = t
        return memo[id(t)]

    swapped = []
    try:
        for table, key in _module_tensors(model, slots=True):
            original = table[key]
            table[key] = fake(original)
            swapped.append((table, key, original))
        yield tuple(fake(x) for x in flat), originals
    finally:
        for table, key, original in reversed(swapped):
            table[key] = original


def _module_tensors(model: nn.Module, *, slots: bool = False):
    """(name, tensor) of every parameter and buffer, duplicates included; with ``slots``
    ((its module's table, its key)) to replace it with."""
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if t is not None:
                    yield (table, key) if slots else (key, t)


_OWN_DIRS = (os.path.dirname(os.path.abspath(__file__)),
             os.path.dirname(os.path.abspath(meshplan.errors.__file__)))


def _is_library_frame(path: str) -> bool:
    """torch's own frames and meshplan's are never the 'user line' an error should name."""
    return "/torch/" in path or path.startswith(_OWN_DIRS) or path.startswith("<")


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """torch logs an operator's failure on fake tensors (with its traceback) before it
    raises; the raised error becomes meshplan's one line, so the log is held back."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# torch's messages for an operator given tensors of shapes it cannot combine (matmul,
# linear, conv, elementwise broadcasting, norms): the example inputs do not fit the model
_SHAPE_ERRORS = re.compile(
    r"same reduction dim|shapes cannot be multiplied|size of tensor a \(\d+\) must match|"
    r"expected input\[.*\] to have \d+ channels|Given normalized_shape=|"
    r"running_mean should contain|is invalid for input of size")


def _explain_trace_failure(exc: Exception, model: nn.Module, inputs=()) -> str:
    """Name the operator or module and the user's source line that stopped tracing; a
    forward that does not take the example inputs is named as such (a calling convention,
    not a traceability problem), and so are inputs of shapes the model's operators cannot
    take (a wrong feature count)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _SHAPE_ERRORS.search(first):
        shapes = ", ".join(f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                           for x in inputs if isinstance(x, torch.Tensor))
        return (f"the example tensors ({shapes}) do not fit {type(model).__name__}: "
                f"{first[:300].rstrip('.')}; give inputs of the shapes its forward takes "
                "(the batch first, then e.g. the feature count its first layer expects)")
    cause = exc
    while cause is not None:
        if isinstance(cause, TypeError) and re.search(
                r"forward\(\) (got an unexpected keyword|missing \d+ required|takes \d+ "
                r"positional|got multiple values)", str(cause)):
            first = str(cause).strip().splitlines()[0]
            return (f"{type(model).__name__}.forward does not take the example inputs "
                    f"({first}); give example inputs that match its signature: a tuple for "
                    "positional arguments, a dict for keyword arguments (targets go only to "
                    "the loss)")
        cause = cause.__cause__ or cause.__context__
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not _is_library_frame(f.filename)]
    where = f"{user[-1].filename}:{user[-1].lineno} ({user[-1].line.strip()})" if user else \
        "an unknown line"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    op = re.search(r"(aten\.\w+(\.\w+)?|torch\.\w+(\.\w+)*)", str(exc))
    op_text = f" in operator {op.group(1)}" if op else ""
    return (f"cannot trace {type(model).__name__}{op_text} at {where}: {first[:300]}. "
            "Make that code traceable by torch.export (no data-dependent Python control flow, "
            "no .item()/.tolist() on tensors, no calls into non-PyTorch libraries), or wrap it "
            "so forward takes and returns tensors.")
