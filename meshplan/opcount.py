"""Operator classes and FLOPs: what each node of the traced graph costs in arithmetic.

trace (**opcount**, called by planner/trace while it builds the OpGraph) -> cost -> solve ->
run. FLOPs follow torch.utils.flop_counter's convention (2 per multiply-add, only
matmul-class work counted: matmuls, convolutions, attention); operators that may do real
work but have no formula are reported in one warning rather than silently counted as 0.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import torch

from meshplan.graph import OpKind, OpNode


# -- operator classes and FLOPs -------------------------------------------------------------

_KIND_PATTERNS: tuple[tuple[OpKind, re.Pattern], ...] = tuple(
    (kind, re.compile(pattern)) for kind, pattern in (
        (OpKind.ATTENTION, r"aten\.(_?scaled_dot_product|_flash_attention|_efficient_attention)"),
        (OpKind.MATMUL, r"aten\.(mm|addmm|bmm|baddbmm|linear|matmul|einsum|_scaled_mm)\."),
        (OpKind.EMBEDDING, r"aten\.embedding\."),
        (OpKind.NORM, r"aten\.(layer_norm|rms_norm|native_layer_norm|group_norm|_fused_rms_norm)"),
        (OpKind.SOFTMAX, r"aten\.(_?softmax|_?log_softmax)\."),
        (OpKind.LOSS, r"aten\.(cross_entropy_loss|nll_loss)"),
        (OpKind.REDUCTION, r"aten\.(sum|mean|amax|amin|max|min|var|std|norm|cumsum|argmax|all|any)\."),
        (OpKind.VIEW, r"aten\.(view|_unsafe_view|reshape|transpose|t|permute|split|split_with_sizes|"
                      r"chunk|cat|stack|slice|select|expand|unsqueeze|squeeze|flatten|unflatten|"
                      r"contiguous|clone|alias|detach|to|_to_copy|index|narrow|unbind|movedim|"
                      r"view_as_complex|view_as_real)\."),
        (OpKind.CREATION, r"aten\.(arange|zeros|ones|full|empty|new_ones|new_zeros|new_full|"
                          r"new_empty|scalar_tensor|tensor|ones_like|zeros_like|full_like|tril|triu)"),
        (OpKind.VIEW, r"^(<built-in function getitem>|getitem)$"),
    )
)


def classify(target: str) -> OpKind:
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(target):
            return kind
    if target.startswith("aten."):
        return OpKind.ELEMENTWISE
    return OpKind.OTHER


def forward_flops(node: torch.fx.Node, target: str) -> int:
    """Forward FLOPs of one node (2 FLOPs per multiply-add; only matmul-class work counts).

    torch.utils.flop_counter's registry has formulas for mm/addmm/bmm/baddbmm, convolution
    and the fused attention kernels (and any a user adds with its ``register_flop_formula``);
    the ops an exported training graph keeps instead (linear, matmul, einsum, conv2d,
    scaled_dot_product_attention, grouped matmuls, transformers' grouped-mm custom op) are
    counted here with the same convention.
    """
    from torch.utils.flop_counter import conv_flop_count, flop_registry

    vals = list(torch.fx.node.map_arg(node.args, lambda a: a.meta.get("val")))
    out = node.meta.get("val")
    packet = getattr(node.target, "overloadpacket", None)
    if packet in flop_registry:
        try:
            return int(flop_registry[packet](*vals, out_val=out, **_kwarg_vals(node)))
        except Exception:  # noqa: BLE001 - fall through to our own formulas
            pass
    if not isinstance(out, torch.Tensor):
        return 0
    if target in ("aten.linear.default", "aten.matmul.default"):
        k = vals[0].shape[-1]
        return 2 * out.numel() * k
    if _CONV.search(target):
        return int(conv_flop_count(list(vals[0].shape), list(vals[1].shape), list(out.shape),
                                   transposed="transpose" in target))
    if _GROUPED_MM.search(target):
        # (tokens, K) x (experts, K, N) -> (tokens, N), or (E, M, K) x (E, K, N): each row
        # of the input meets one expert's K x N weight
        return 2 * vals[0].numel() * out.shape[-1]
    if target.startswith("aten.einsum"):
        return _einsum_flops(vals[0], vals[1])
    if _ATTENTION.search(target):
        q, k, v = vals[0], vals[1], vals[2]
        batch = q.numel() // (q.shape[-2] * q.shape[-1])
        # QK^T and softmax(QK^T) V: (Sq x D) by (D x Sk), then (Sq x Sk) by (Sk x Dv)
        return 2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return 0


_CONV = re.compile(r"^aten\.(conv[123]d|conv_transpose[123]d|conv_tbc)\.")
_GROUPED_MM = re.compile(r"(^aten\._grouped_mm\.|\.grouped_mm(_fallback)?\.)")
_ATTENTION = re.compile(r"^aten\.(scaled_dot_product_attention|_scaled_dot_product_\w+)\.")


def _einsum_flops(equation: str, operands) -> int:
    """2 x the product of every index's size (each output element sums over the rest)."""
    spec = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, t in zip(spec, operands):
        if "..." in term:  # the ellipsis stands for the leading dims not named
            n = t.dim() - len(term.replace("...", ""))
            term = term.replace("...", "".join(chr(0x2460 + i) for i in range(n)))
        for letter, size in zip(term, t.shape):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    total = 1
    for size in sizes.values():
        total *= size
    return 2 * total


# Higher-order operators that only wrap a no-grad or autocast region (Llama's rotary
# cos/sin): their bodies build position tables, no model work
_STRUCTURAL = ("wrap_with_set_grad_enabled", "wrap_with_autocast", "<built-in function getitem>",
               "getitem")
# aten operators whose work is matmul-class: zero FLOPs for one of them means no formula
_HEAVY = re.compile(r"^aten\.(\w*mm(_\w+)?|_?conv(olution|_transpose[123]d|[123]d|_tbc)\w*|"
                    r"einsum|\w*attention\w*|tensordot|matmul|linear|bilinear)\.")


class UncountedOperatorsWarning(UserWarning):
    """Operators of the traced graph whose FLOPs meshplan does not know (counted as 0)."""


def uncounted_operators(nodes: Sequence[OpNode]) -> dict[str, int]:
    """{target: count} of the operators with no FLOPs formula that may do real work: custom
    operators and matmul-class aten operators that came out at 0 FLOPs."""
    out: dict[str, int] = {}
    for n in nodes:
        if n.flops or n.target in _STRUCTURAL or n.kind in (OpKind.VIEW, OpKind.CREATION):
            continue
        if not n.target.startswith("aten.") or _HEAVY.search(n.target):
            out[n.target] = out.get(n.target, 0) + 1
    return out


def warn_uncounted(nodes: Sequence[OpNode], model_name: str) -> None:
    """One warning listing every uncounted operator and its share of the graph's bytes."""
    unknown = uncounted_operators(nodes)
    if not unknown:
        return
    moved = sum(n.bytes_read + n.bytes_written for n in nodes) or 1
    theirs = sum(n.bytes_read + n.bytes_written for n in nodes if n.target in unknown)
    listed = ", ".join(f"{t} x{c}" for t, c in sorted(unknown.items()))
    warnings.warn(
        f"{model_name}: {sum(unknown.values())} of {len(nodes)} operators have no FLOPs "
        f"formula and count 0 FLOPs ({listed}; {100 * theirs / moved:.1f}% of the graph's "
        "bytes): step times are underestimated by their compute; register a formula with "
        "torch.utils.flop_counter.register_flop_formula", UncountedOperatorsWarning,
        stacklevel=3)


def _kwarg_vals(node: torch.fx.Node) -> dict:
    return {k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v)
            for k, v in node.kwargs.items()}


