"""Worker for tests/test_cp_modules.py: context parallelism on the module engine through the
public API, in a user's own loop, against one plain-PyTorch process.

Each case builds the model on meta, plans it with ``meshplan.manual_plan(..., cp=..)``,
``meshplan.parallelize`` + ``load_full_state_dict``, then AdamW with an LR schedule for
three steps, each rank passing ONLY its own rows (``run.dp_rank``/``run.dp_size``, whole
sequences), ``run.clip_grad_norm_`` at a norm that clips, eval outputs and
``run.full_state_dict()``. The reference runs the same steps in one process
(tests/harness/equivalence.py's trainer, fp32 and fp64: the test applies its rule).
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import meshplan
from tests.harness.equivalence import layout

STEPS, LR, CLIP, BATCH, SEQ, VOCAB = 3, 1e-2, 0.3, 4, 16, 64


class Block(nn.Module):
    def __init__(self, d, heads, masked=False):
        super().__init__()
        self.heads, self.masked = heads, masked
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.c_attn(self.ln1(x)).split(d, dim=2))
        if self.masked:  # an explicit mask: the graph engine's cp runs it (runtime/graph/context.py)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TiedGPT(nn.Module):
    """nanoGPT's layout: learned positions from ``torch.arange(t)``, is_causal=True attention,
    the head tied to the token embedding."""

    def __init__(self, vocab=VOCAB, d=32, heads=4, layers=2, max_seq=32, masked=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.h = nn.ModuleList(Block(d, heads, masked) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def gpt(device):
    with torch.device(device):
        return TiedGPT()


def masked_gpt(device):
    with torch.device(device):
        return TiedGPT(masked=True)


def data():
    """Token ids, and labels with -100 at random places (rows count differently)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    labels[torch.rand(BATCH, SEQ, generator=g) < 0.3] = -100
    labels[0, 3:] = -100  # row 0 has only three labelled tokens
    return ids, labels


def logits_of(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def reference(build, with_targets, dtype) -> dict:
    """The same steps in one process on the whole batch (tests/harness/equivalence.py's
    trainer): losses, clipped norms, eval outputs, the final state."""
    from tests.harness.equivalence import train_reference

    ids, labels = data()
    if not with_targets:
        labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)

    def seeded():
        torch.manual_seed(0)
        return build("cpu")

    def loss(logits, batch):
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1),
                               ignore_index=-100)
    ref = train_reference(
        seeded, [(ids, labels)] * STEPS, lambda model, batch: logits_of(model, batch[0]), loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
        schedule=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        clip=CLIP, eval_batch=(ids, labels), dtype=dtype)
    return {k: ref[k] for k in ("losses", "norms", "eval", "weights")}


def rows(value, run):
    n = value.shape[0] // run.dp_size
    return value[run.dp_rank * n:(run.dp_rank + 1) * n]


def case(build, options, with_targets):
    ref = reference(build, with_targets, torch.float32)
    ref64 = reference(build, with_targets, torch.float64)
    torch.manual_seed(0)
    start = build("cpu")
    ids, labels = data()
    meta = build("meta")
    targets = (labels.to("meta"),) if with_targets else ()
    plan = meshplan.manual_plan(meta, meshplan.Mesh.local(dist.get_world_size()),
                                example_inputs=(ids.to("meta"),), example_targets=targets,
                                dtype="fp32", **options)
    run = meshplan.parallelize(meta, plan)
    run.load_full_state_dict({**start.state_dict(), **dict(start.named_buffers())},
                             strict=False)
    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses, norms = [], []
    for _ in range(STEPS):
        mine = (rows(labels, run),) if with_targets else ()
        losses.append(run.train_step((rows(ids, run),), targets=mine))
        norms.append(run.clip_grad_norm_(CLIP))
        opt.step()
        sched.step()
        opt.zero_grad()
    final = run.full_state_dict()
    run.eval()
    out = run((rows(ids, run),))
    run.train()
    return {"losses": losses, "norms": norms, "final": final, "eval": out,
            "eval_rows": (run.dp_rank, run.dp_size), "engine": run.engine_name,
            "axes": dict(zip(plan.stages[0].axis_names, plan.stages[0].mesh_shape)),
            "ref": ref, "ref64": ref64}


CASES = {  # name -> (model, manual_plan options: a layout of tests/harness/equivalence.py,
    #         token targets with -100 given)
    "gpt_cp4": (gpt, layout("cp4"), True),
    "gpt_dp2_cp2_zero3": (gpt, layout("cp2xdp2+zero3"), True),
    "llama_cp4": (llama, layout("cp4"), False),
    "llama_dp2_cp2_zero1": (llama, layout("cp2xdp2+zero1"), False),
    "llama_cp2_tp2_sp": (llama, layout("cp2xtp2+sp"), False),
    # recompute replays each block's ring attention inside the backward's cp region
    "gpt_dp2_cp2_full_zero2": (gpt, layout("cp2xdp2+full+zero2"), True),
    "llama_cp2_pp2_mb1": (llama, layout("cp2xpp2+mb1"), False),
    "llama_cp2_pp2_mb2": (llama, layout("cp2xpp2+mb2"), True),
    # an explicit mask: the module engine refuses it, the graph engine runs it (each rank's
    # own rows: DECISIONS, the graph engine's cp input cut)
    "masked_dp2_cp2_graph": (masked_gpt, layout("cp2xdp2"), False),
    # and with labels (-100, each row its own count): DTensor's loss backward is the whole
    # microbatch's labelled mean (runtime/loss_weights.weight, dtensor_backward)
    "masked_dp2_cp2_graph_labels": (masked_gpt, layout("cp2xdp2"), True),
    # a graph-engine pipeline with cp (tied head across stages): eval in sequence order
    "masked_cp2_pp2_graph": (masked_gpt, layout("cp2xpp2+mb2"), True),
}


def mechanism() -> dict:
    """Ring attention (runtime/cp_modules.cp_region) on a 1-D cp mesh of every rank against
    plain SDPA in one process: (max error of out, dq, dk, dv in fp32 against fp64, the fp32
    one-process error against fp64), causal and full."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.runtime.cp_modules import cp_region, unshard

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(2, 3, 4 * n, 8, dtype=torch.float64, generator=g)
                  for _ in range(4))
    out = {}
    for causal in (True, False):
        def plain(dtype):
            leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            (o * w.to(dtype)).sum().backward()
            return [o.detach()] + [t.grad for t in leaves]
        want, own = plain(torch.float64), plain(torch.float32)
        parts = [t.clone().float() for t in (q, k, v, w)]
        with cp_region(mesh, parts, [2] * 4, causal=causal):
            leaves = [t.requires_grad_() for t in parts[:3]]
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            (o * parts[3]).sum().backward()
        got = [unshard(mesh, t, causal=causal, seq_dim=2)
               for t in [o.detach()] + [t.grad for t in leaves]]
        out[causal] = (max((a.double() - b).abs().max().item() for a, b in zip(got, want)),
                       max((a.double() - b).abs().max().item() for a, b in zip(own, want)))
    return out


def main():
    import traceback
    dist.init_process_group("gloo")
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    out = {"mechanism": mechanism()}
    for name in names:
        build, options, with_targets = CASES[name]
        try:
            out[name] = case(build, options, with_targets)
        except Exception as exc:  # noqa: BLE001 - one broken case must not hide the rest
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:],
                         "traceback": traceback.format_exc()[-4000:]}
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
