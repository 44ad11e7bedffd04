"""runtime/graph/programs._local_attention (DECISIONS 64): attention on DTensors split by batch
and heads runs on each rank's local shards. On 4 gloo processes, for every layout it takes
(batch split, heads split, both on a 2 x 2 mesh, GQA, a per-row mask, a broadcast mask, a
causal mask), its output and the gradients of q, k and v equal plain one-process attention
(F.scaled_dot_product_attention on the full tensors); the layouts it must leave to DTensor
(sequence split, dropout) return None."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

B, H, HK, S, D = 4, 4, 2, 8, 8

# name -> (mesh shape, q/k/v placements as (kind, dim) per mesh axis, gqa, mask kind, causal)
LAYOUTS = {
    "batch": ((4,), [("S", 0)], False, None, False),
    "heads": ((4,), [("S", 1)], False, None, False),
    "batch-x-heads": ((2, 2), [("S", 0), ("S", 1)], False, None, False),
    "heads-x-batch": ((2, 2), [("S", 1), ("S", 0)], False, None, False),
    "batch-twice": ((2, 2), [("S", 0), ("S", 0)], False, None, False),
    "gqa-heads": ((2, 2), [("S", 0), ("S", 1)], True, None, False),
    "row-mask": ((2, 2), [("S", 0), ("S", 1)], False, "rows", False),
    "broadcast-mask": ((2, 2), [("S", 0), ("S", 1)], False, "broadcast", False),
    "causal": ((2, 2), [("R", 0), ("S", 1)], False, None, True),
}
REFUSED = {  # layouts left to DTensor's rules: _local_attention returns None
    "sequence": ((4,), [("S", 2)], 0.0),
    "dropout": ((4,), [("S", 0)], 0.1),
}


def tensors(gqa: bool, mask_kind):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, HK if gqa else H, S, D, generator=g)
    v = torch.randn(B, HK if gqa else H, S, D, generator=g)
    mask = None
    if mask_kind == "rows":  # (b, 1, s, s): each row its own padding
        mask = torch.rand(B, 1, S, S, generator=g) > 0.3
        mask[..., 0] = True
    elif mask_kind == "broadcast":  # (s, s)
        mask = torch.rand(S, S, generator=g) > 0.3
        mask[:, 0] = True
    return q, k, v, mask


def worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshplan.runtime.graph.programs import _local_attention

    dist.init_process_group("gloo")

    def placements(spec):
        return [Shard(d) if kind == "S" else Replicate() for kind, d in spec]

    results = {}
    for name, (shape, spec, gqa, mask_kind, causal) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", shape)
        q, k, v, mask = tensors(gqa, mask_kind)
        dq, dk, dv = (distribute_tensor(t, mesh, placements(spec)).requires_grad_()
                      for t in (q, k, v))
        dmask = None if mask is None else distribute_tensor(mask, mesh, [Replicate()] * len(shape))
        got = _local_attention(dq, dk, dv, dmask, 0.0, causal, None, gqa)
        if got is None:
            results[name] = None
            continue
        got.sum().backward()
        results[name] = {"out": got.full_tensor().detach(),
                         "grads": [t.grad.full_tensor() for t in (dq, dk, dv)],
                         "placements": [str(p) for p in got.placements]}
    for name, (shape, spec, p) in REFUSED.items():
        mesh = init_device_mesh("cpu", shape)
        q, k, v, _ = tensors(False, None)
        dq, dk, dv = (distribute_tensor(t, mesh, placements(spec)) for t in (q, k, v))
        results[name] = _local_attention(dq, dk, dv, None, p, False, None, False)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("attn") / "out.pt", nproc=4,
                          timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_local_attention_equals_one_process(launched, name):
    shape, spec, gqa, mask_kind, causal = LAYOUTS[name]
    got = launched[name]
    assert got is not None, f"{name}: _local_attention refused a batch/heads layout"
    q, k, v, mask = tensors(gqa, mask_kind)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=gqa)
    want.sum().backward()
    torch.testing.assert_close(got["out"], want.detach(), rtol=1e-5, atol=1e-6)
    for g, ref in zip(got["grads"], (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
    assert got["placements"] == [f"S({d})" if kind == "S" else "R" for kind, d in spec]


@pytest.mark.parametrize("name", list(REFUSED))
def test_other_layouts_are_left_to_dtensor(launched, name):
    assert launched[name] is None


if __name__ == "__main__":
    worker(sys.argv[1])
