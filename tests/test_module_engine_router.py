"""A user's mixture of experts whose router is an ``nn.Linear`` (softmax, then top-k over its
outputs) and whose experts are an ``nn.ModuleList`` of MLPs, planned at dp2 x tp2: the plan
shards the router's weight by rows (its output split over tp) and gathers that output before
the softmax. The module engine paired the router with the experts' row-parallel layers by
call order and handed each rank its own columns: each rank routed on half the experts'
scores (a new user's trial: losses 2.9e-3 and gradient norms 1.3e-2 off one process, no
warning). Now the module engine refuses such a plan in one line and the graph engine, which
performs the plan's redistribution, runs it (equal to one process in that trial: losses equal,
weights within 6e-8)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import meshplan

D = 32


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, n=4, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(D, n, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(n))

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        w, idx = probs.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (w * (idx == e)).sum(-1, keepdim=True) * expert(x)
        return out


class Block(nn.Module):
    def __init__(self, mlp: bool):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.ffn = Expert() if mlp else MoE()

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class Net(nn.Module):
    """Token ids -> embedding -> two residual blocks -> norm -> head (the user's layout)."""

    def __init__(self, mlp=False):
        super().__init__()
        self.emb = nn.Embedding(64, D)
        self.blocks = nn.ModuleList(Block(mlp) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 64, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           label_smoothing=0.1)


def _plan(mlp: bool):
    with torch.device("meta"):
        model = Net(mlp)
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    return meshplan.manual_plan(model, meshplan.Mesh.local(4), (ids,), example_targets=(ids,),
                                loss_fn=_loss, dp=2, tp=2)


def test_a_linear_router_under_tp_goes_to_the_graph_engine_with_the_reason():
    plan = _plan(mlp=False)
    assert plan.engine == "graph"
    assert ".router is column-parallel and the plan gathers what it computes" \
        in plan.engine_note and "\n" not in plan.engine_note


def test_the_same_blocks_without_a_router_stay_on_the_module_engine():
    plan = _plan(mlp=True)
    assert plan.engine == "modules", plan.engine_note
