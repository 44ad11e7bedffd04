"""torch.compile under torchtitan's op-level selective activation checkpointing, measured on
one GPU against the cost model (issue 26: torchtitan's compiled H100 rows are predicted 12%
fast while its eager rows are 9% fast, and the estimate saves about 0.44 s of compile per
8-GPU step where torchtitan's tables show 0.39 s; the one-GPU check of
benchmarks/gpu_check.py compiles blocks without selective AC, so it cannot tell whether the
fusion model or the SAC-with-compile composition is off).

What runs: ``BLOCKS`` Llama 3.1 8B decoder blocks as torchtitan writes them
(benchmarks/torchtitan_llama.py ``TransformerBlock``: hidden 4096, 32 query / 8 KV heads,
SwiGLU 14336, the rotary embedding on complex numbers that inductor leaves unfused,
DECISIONS 105; the complex64 table stays complex64, as torchtitan keeps it) on hidden
states of ``BATCH`` x ``SEQ`` tokens (torchtitan's local batch), in two regimes
(``REGIMES``): bf16 parameters on bf16 states (FSDP2's mixed-precision compute, as the
published multi-GPU rows run) and fp32 parameters on fp32 states under ``torch.autocast``
(torchtitan on one GPU), a scalar loss; forward + backward timed, with and without torchtitan's op-level selective AC
(``torchtitan_policy``: its rule as DECISIONS 98 describes it), eager and with every block
``torch.compile``d after the checkpoint wrapper (torchtitan's ``apply_ac`` then
``apply_compile``). SDPA is pinned to its flash backend, the kernel torchtitan's December 2024
runs ran (DECISIONS 102) and the one their save list names.

``measure()`` runs on the GPU (``gpu_check.py measure`` section ``sac_compile``);
``predict(preset, regime)`` prices the same step on the CPU machine with
``meshplan.manual_plan(..., engine="torchtitan")`` and ``meshplan.estimate(plan,
compiled=...)`` (forward + backward + recompute of the breakdown; no optimizer, no
communication). ``measure()`` also times back-to-back GEMMs of the block's largest shape
(``gemm_loop``) and keeps each mode's wall-clock window, to read against an SM-clock log
taken beside it (benchmarks/gpu/run_on_device.sh).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from functools import partial

import torch
from torch import nn

from model import init_weights

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _BENCHMARKS not in sys.path:
    sys.path.append(_BENCHMARKS)
from torchtitan_llama import TransformerBlock, freqs_table  # noqa: E402

BATCH, SEQ, BLOCKS = 2, 8192, 4
DIMS = {"dim": 4096, "heads": 32, "kv_heads": 8, "hidden": 14336}  # Llama 3.1 8B's block
THETA = 500000.0
MODES = (("selective", False), ("selective", True), ("none", False), ("none", True))
# how the blocks hold their weights: "bf16", FSDP2's mixed-precision compute (bf16 parameters,
# torchtitan's published multi-GPU rows); "autocast", fp32 parameters under torch.autocast
# (torchtitan's ``maybe_enable_amp`` where FSDP2 does not wrap the model: one GPU)
REGIMES = ("bf16", "autocast")


class Blocks(nn.Module):
    """Decoder blocks on hidden states (no embedding, head or loss kernels of their own)."""

    def __init__(self, blocks: int = BLOCKS, dim: int = DIMS["dim"], heads: int = DIMS["heads"],
                 kv_heads: int = DIMS["kv_heads"], hidden: int = DIMS["hidden"]):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, kv_heads, hidden, 1e-5)
                                    for _ in range(blocks))
        self.register_buffer("freqs_cis", freqs_table(dim // heads, SEQ, THETA),
                             persistent=False)

    def forward(self, x):
        freqs_cis = self.freqs_cis[: x.shape[1]]
        for block in self.layers:
            x = block(x, freqs_cis)
        return x


def loss_fn(out, *rest):
    return out.float().pow(2).mean()


def torchtitan_policy(count, ctx, func, *args, **kwargs):
    """torchtitan's op rule (9dec370 ``_apply_op_sac``, DECISIONS 98): count ``aten.mm`` per
    block, separately in the forward and the recompute; save SDPA's outputs and every mm's
    but the 2nd, 4th, ...; recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten.max.default}
    key = "recompute" if ctx.is_recompute else "forward"
    if func == aten.mm.default:
        count[key] += 1
    keep = func in save and not (func == aten.mm.default and count[key] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def build(ac: str, compiled: bool, device: str, regime: str = "bf16", **dims) -> Blocks:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    if compiled:
        # a fresh dynamo, as torchtitan's process has: gpu_check.py's earlier sections
        # compile model.py's Block at another size, and a second size makes dynamo retrace
        # with symbolic shapes (automatic dynamic shapes)
        torch._dynamo.reset()
    torch.manual_seed(0)
    net = Blocks(**dims)
    table = net.freqs_cis
    if regime == "bf16":
        net = net.to(device=device, dtype=torch.bfloat16)
    else:
        net = net.to(device=device)
    net.freqs_cis = table.to(device)  # Module.to(dtype) would cast the complex table to bf16
    init_weights(net)
    for i, block in enumerate(list(net.layers)):
        if ac == "selective":
            block = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=lambda: (
                create_selective_checkpoint_contexts(partial(torchtitan_policy,
                                                             defaultdict(int)))))
        net.layers[i] = torch.compile(block) if compiled else block
    return net


def run_step(net: Blocks, x, regime: str = "bf16") -> float:
    """Forward + backward into fresh gradients (torchtitan zeroes them every step; nothing
    adds to the last step's); under ``torch.autocast`` to bf16 in the "autocast" regime."""
    from contextlib import nullcontext
    for p in net.parameters():
        p.grad = None
    amp = torch.autocast(x.device.type, dtype=torch.bfloat16) if regime == "autocast" \
        else nullcontext()
    with amp:
        loss = loss_fn(net(x))
    loss.backward()
    return float(loss.detach())


def measure(steps: int = 10, regimes: tuple[str, ...] = REGIMES, **dims) -> dict:
    """Forward + backward of each regime and mode on the GPU: median of ``steps`` after two
    warm-ups (compile, allocator), [min, max], peak allocated GiB, and the wall-clock window
    of the timed steps (``window``: epoch seconds, to read an SM-clock log against)."""
    import statistics
    import time

    from torch.nn.attention import SDPBackend, sdpa_kernel
    dim = dims.get("dim", DIMS["dim"])
    out = {}
    for regime in regimes:
        for ac, compiled in MODES:
            net = build(ac, compiled, "cuda", regime, **dims)
            x = torch.randn(BATCH, SEQ, dim, device="cuda",
                            dtype=torch.bfloat16 if regime == "bf16" else torch.float32)
            torch.cuda.reset_peak_memory_stats()
            times = []
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                for i in range(steps + 2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if i == 2:
                        start = time.time()
                    run_step(net, x, regime)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            t = times[2:]
            key = f"{ac}_{'compiled' if compiled else 'eager'}"
            out.setdefault(regime, {})[key] = {
                "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "window": [start, time.time()]}
            del net, x
            torch.cuda.empty_cache()
    res = {"batch": BATCH, "seq": SEQ, "blocks": BLOCKS, "dims": {**DIMS, **dims},
           "modes": out.get("bf16", {}), "regimes": out}
    # back-to-back GEMMs of the block's largest shape on random data, for the clock log
    a = torch.randn(BATCH * SEQ, dim, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, DIMS["hidden"], device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.time()
    calls = 0
    while time.time() - start < 3.0:
        for _ in range(20):
            torch.mm(a, b)
        torch.cuda.synchronize()
        calls += 20
    wall = time.time() - start
    res["gemm_loop"] = {"window": [start, start + wall], "calls": calls,
                        "tflops": 2 * a.shape[0] * dim * DIMS["hidden"] * calls / wall / 1e12}
    return res


def traced_plan(preset: str, regime: str = "bf16", recompute: str = "none", **dims):
    """(meta blocks, their graph, the plan) meshplan prices a ``regime`` step on, through the
    public API, on ``preset`` with its fa2 attention curve: "autocast", the one-GPU plan
    (torchtitan without FSDP2 runs autocast on fp32 weights); "bf16", a 2-GPU ZeRO-3 plan at
    the same local batch (meshplan prices bf16 parameters where FSDP2 holds the blocks)."""
    from dataclasses import replace

    import meshplan
    dim = dims.get("dim", DIMS["dim"])
    dp = 2 if regime == "bf16" else 1
    with torch.device("meta"):
        net = Blocks(**dims)
    x = torch.zeros(dp * BATCH, SEQ, dim, device="meta")
    graph = meshplan.trace(net, (x,), loss_fn=loss_fn)
    mesh = meshplan.Mesh.from_dict({"shape": [dp], "hardware": preset,
                                    "name": f"{preset}:{dp}"})
    hw = mesh.hardware
    mesh = replace(mesh, hardware=replace(hw, device=hw.device.with_attention_kernel("fa2")))
    plan = meshplan.manual_plan(net, mesh, graph=graph, dp=dp, zero=3 if dp > 1 else 0,
                                dtype="bf16", recompute=recompute, microbatch_size=BATCH,
                                engine="torchtitan")
    return net, graph, plan


def predict(preset: str, regime: str = "bf16", **dims) -> dict:
    """The same step priced by meshplan (``traced_plan``): {mode: seconds of forward +
    backward + recompute}. The "bf16" plan's forward and backward also count FSDP2's
    copy-out / copy-in kernels (about 2% of this step) that the one-GPU run does not launch;
    its collectives are left out (``breakdown["comm"]``)."""
    from dataclasses import replace

    import meshplan
    _, _, base = traced_plan(preset, regime, **dims)
    out = {}
    for ac, compiled in MODES:
        plan = replace(base, stages=tuple(replace(s, recompute=ac) for s in base.stages))
        b = meshplan.estimate(plan, compiled=compiled).breakdown
        out[f"{ac}_{'compiled' if compiled else 'eager'}"] = \
            b["forward"] + b["backward"] + b["recompute"]
    return out
