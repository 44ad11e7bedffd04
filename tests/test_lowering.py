"""The lowered program's constant folding and parameter leaves (runtime/graph/spmd.py,
runtime/graph/lowering.py), checked against the DTensor reference executor.

One torchrun launch of 2 gloo processes (this file is the worker) trains a small Llama under
a data-parallel plan twice, once with the lowered program and once on DTensor
(``lowered=False``), changes a buffer the folded constants are made from (the rotary
``inv_freq``) half-way, and records the losses, whether the lowered executor folded the
causal mask, and the gradient types.
"""

from __future__ import annotations

import sys

import pytest
import torch

LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=2&"
         "num_attention_heads=4&num_key_value_heads=4&vocab_size=256&"
         "max_position_embeddings=64")
STEPS, CHANGE_AT = 4, 2


def run(lowered: bool) -> dict:
    from meshplan.planner.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.tracing import trace
    from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph
    from meshplan.specs import example_inputs, parse_model_spec, synthetic_batch

    spec = parse_model_spec(LLAMA)
    meta = spec.build(device="meta")
    graph = trace(meta, example_inputs(meta, 4, 32))
    plan = build_manual_plan(graph, Mesh.local(2), dp=2)
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    pm = parallelize_graph(model, plan, (synthetic_batch(model, 4, 32, seed=0, step=0),),
                     lowered=lowered)
    opt = make_optimizer(pm.optimizer_params(), pm.plan)
    losses, folded = [], []
    for step in range(STEPS):
        if step == CHANGE_AT:  # as a checkpoint load would: the buffer changes in place
            inv_freq = next(v for k, v in pm.params.items() if k.endswith("inv_freq"))
            with torch.no_grad():
                inv_freq.to_local().mul_(0.5)
        losses.append(pm.train_step(synthetic_batch(model, 4, 32, seed=0, step=step), opt))
        folded.append(sorted(n.name for n in pm._executor.folder.folded))
    pm.loss(synthetic_batch(model, 4, 32, seed=0, step=STEPS).chunk(
        plan.training.microbatches)[0]).backward()
    grads = {fqn: p.grad.full_tensor() for fqn, p in pm.named_unique_params().items()}
    causal = sorted(n.name for n, (_, ok) in pm._executor._causal.items() if ok)
    return {"losses": losses, "folded": folded, "grads": grads, "causal": causal,
            "grad_types": sorted({type(p.grad).__name__ for p in pm.unique_params()}),
            "constant": sorted(n.name for n in pm._executor.folder.constant)}


def run_zero(level: int) -> dict:
    """Three steps of a Llama with an odd vocabulary (uneven dim-0 shards) at ZeRO ``level``
    over 2 data-parallel ranks; which parameters took the flat collectives."""
    from meshplan.planner.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.tracing import trace
    from meshplan.runtime.graph import zero
    from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph
    from meshplan.specs import example_inputs, parse_model_spec, synthetic_batch

    spec = parse_model_spec(LLAMA.replace("vocab_size=256", "vocab_size=255"))
    meta = spec.build(device="meta")
    graph = trace(meta, example_inputs(meta, 4, 32))
    plan = build_manual_plan(graph, Mesh.local(2), dp=2, zero=level)
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    pm = parallelize_graph(model, plan, (synthetic_batch(model, 4, 32, seed=0, step=0),))
    opt = make_optimizer(pm.optimizer_params(), pm.plan)
    flat = {"grads": 0, "gathers": 0}
    spied = (zero.reduce_scatter_grads, zero.gather_into_params)

    def count(key, real):
        def call(pairs):
            done = real(pairs)
            flat[key] += len(done)
            return done
        return call
    zero.reduce_scatter_grads = count("grads", spied[0])
    zero.gather_into_params = count("gathers", spied[1])
    try:
        losses = [pm.train_step(synthetic_batch(model, 4, 32, seed=0, step=s), opt)
                  for s in range(3)]
    finally:
        zero.reduce_scatter_grads, zero.gather_into_params = spied
    return {"losses": losses, "flat": flat, "masters": len(pm.masters),
            "params": {k: v.detach() for k, v in pm.full_state().items()}}


def worker(out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {"lowered": run(True), "dtensor": run(False),
               "zero": {level: run_zero(level) for level in (0, 1, 2)}}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()  # no rank tears gloo down while a peer still works (aborts)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("lowering") / "results.pt")


def test_losses_and_grads_equal_the_dtensor_executor(results):
    ours, ref = results["lowered"], results["dtensor"]
    torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
    assert ours["grads"].keys() == ref["grads"].keys()
    for name in ref["grads"]:
        torch.testing.assert_close(ours["grads"][name], ref["grads"][name], rtol=1e-4,
                                   atol=1e-6, msg=lambda m: f"{name}: {m}")
    # parameter leaves hand the runtime DTensor gradients, as the DTensor executor does
    assert ours["grad_types"] == ref["grad_types"] == ["DTensor"]


def test_mask_and_rotary_are_folded_and_refreshed_when_a_buffer_changes(results):
    ours = results["lowered"]
    constant = set(ours["constant"])
    # the causal mask (arange ... expand) and the rotary cos/sin depend on shapes and the
    # inv_freq buffer only; nothing downstream of the token ids or a weight is constant
    # (the rotary cos/sin: one higher-order operator where transformers computes them under
    # no_grad, up to 5.23; the cos and sin operators themselves from 5.24 on)
    assert "arange" in constant and ("wrap_with_set_grad_enabled" in constant
                                     or {"cos", "sin"} <= constant), constant
    assert not any(n.startswith(("embedding", "linear", "mm", "cross_entropy"))
                   for n in constant), constant
    assert all(ours["folded"]), ours["folded"]  # every step ran on folded values
    # the buffer changed before step CHANGE_AT: the losses still equal the reference's
    # (test above), which they would not with stale cos/sin; and the step before shows
    # that the change matters
    ref = results["dtensor"]["losses"]
    assert abs(ref[CHANGE_AT] - ours["losses"][CHANGE_AT]) < 1e-5


def test_the_folded_causal_mask_runs_as_is_causal(results):
    """The export materialized Llama's causal mask; the lowered program recognizes the
    folded mask and calls attention with is_causal=True (the losses and gradients above
    still equal the DTensor executor's)."""
    assert results["lowered"]["causal"], "the lowered program kept the materialized mask"
    assert results["dtensor"]["causal"] == []


def test_is_causal_mask_accepts_only_the_causal_pattern():
    from meshplan.runtime.graph.lowering import is_causal_mask

    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    assert is_causal_mask(tril.expand(2, 1, 4, 4), 4, 4)
    additive = torch.zeros(4, 4).masked_fill(~tril, torch.finfo(torch.float32).min)
    assert is_causal_mask(additive[None, None], 4, 4)
    assert is_causal_mask(torch.zeros(4, 4).masked_fill(~tril, float("-inf")), 4, 4)
    padded = tril.clone()
    padded[:, 0] = False  # a padding mask on top of the causal one
    assert not is_causal_mask(padded, 4, 4)
    assert not is_causal_mask(torch.stack([tril, padded])[:, None], 4, 4)  # one row differs
    assert not is_causal_mask(additive.masked_fill(~tril, -1.0), 4, 4)  # a bias, not a mask
    assert not is_causal_mask(torch.ones(4, 4, dtype=torch.bool), 4, 4)  # full attention
    assert not is_causal_mask(torch.ones(3, 4, dtype=torch.bool).tril(), 3, 4)  # q != kv


def test_zero_1_and_2_use_flat_collectives_and_train_like_data_parallelism(results):
    """runtime/graph/zero.py: every master's gradient comes by one flat reduce-scatter (ZeRO-2) or
    the flat all-reduce (ZeRO-1), every parameter is refreshed by one flat all-gather, with
    uneven shards (vocabulary 255 over 2 ranks), and the run equals plain data parallelism."""
    runs = results["zero"]
    for level in (1, 2):
        got = runs[level]
        assert got["masters"] > 0
        steps = 3
        assert got["flat"]["gathers"] == steps * got["masters"], got["flat"]
        assert got["flat"]["grads"] == (steps * got["masters"] if level == 2 else 0)
        torch.testing.assert_close(got["losses"], runs[0]["losses"], rtol=1e-5, atol=1e-6)
        for name, value in runs[0]["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"ZeRO-{level} {name}: {m}")


def test_bucketed_gather_cuts_each_member_along_its_own_dim():
    """ZeRO-3's one all-gather per block (runtime/graph/gathers.py) lays n ranks' flat shards in
    rows; each member is the concatenation of its rows' shards along the dim it is sharded
    on (a tensor-parallel weight's ZeRO shard is dim 1), and the backward's rows are the
    exact inverse."""
    from meshplan.runtime.graph.lowering import _stack, _unstack

    full = torch.randn(6, 4, 10)
    for dim, n in ((0, 2), (1, 4), (2, 5)):
        chunks = full.chunk(n, dim)
        rows = torch.stack([c.reshape(-1) for c in chunks])
        assert torch.equal(_unstack(rows, chunks[0].shape, dim), full), dim
        assert torch.equal(_stack(full, n, dim), rows), dim
    # two members in one buffer, as the all-gather returns them: each rank's row holds its
    # shard of a (cut on dim 1) then of b (cut on dim 0); each is a column slice of the rows
    a, b, n = torch.randn(3, 8), torch.randn(4, 5), 2
    rows = torch.stack([torch.cat([ca.reshape(-1), cb.reshape(-1)])
                        for ca, cb in zip(a.chunk(n, 1), b.chunk(n, 0))])
    assert torch.equal(_unstack(rows[:, :12], torch.Size((3, 4)), 1), a)
    assert torch.equal(_unstack(rows[:, 12:], torch.Size((2, 5)), 0), b)
    assert torch.equal(torch.cat([_stack(a, n, 1), _stack(b, n, 0)], dim=1), rows)


if __name__ == "__main__":
    worker(sys.argv[1])
