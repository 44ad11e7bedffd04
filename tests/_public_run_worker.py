"""torchrun worker for tests/test_public_run.py: the public API in a user's own loop.

Each case builds the model on the meta device, plans it on Mesh.local(world), runs
``meshplan.parallelize`` + ``load_full_state_dict`` + a stock AdamW for two steps with
gradient clipping, and records losses, gradient norms and the final full state; the test
compares them with one plain-PyTorch process (``initial``, ``forward``, ``loss`` here, trained
by tests/harness/equivalence.py). Bad-input cases record the error line.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import meshplan

STEPS, LR, CLIP = 2, 1e-2, 0.5


class BiasedMLP(nn.Module):
    """Hand-written, torchtitan-style: blocks in an nn.ModuleDict, biased nn.Linear layers,
    a classifier head, class-label targets."""

    def __init__(self, d=32, classes=10, layers=2):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                           nn.Linear(2 * d, d))
                                     for i in range(layers)})
        self.head = nn.Linear(d, classes)

    def forward(self, x, scale):
        h = self.inp(x) * scale
        for block in self.layers.values():
            h = h + block(h)
        return self.head(h)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM, cfg


def build(kind):
    if kind == "mlp":
        return BiasedMLP, None
    return llama()


def make(kind, cls, cfg, device):
    with torch.device(device):
        return cls(cfg) if cfg is not None else cls()


def data(kind, batch):
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        x = torch.randn(batch, 16, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        return {"x": x, "scale": torch.full((batch, 1), 0.5)}, (y,)
    return (torch.randint(0, 96, (batch, 8), generator=g),), ()


def initial(kind):
    """The seeded model on the CPU: what tests/test_public_run.py's one-process reference
    (tests/harness/equivalence.py) starts from."""
    cls, cfg = build(kind)
    torch.manual_seed(0)
    return make(kind, cls, cfg, "cpu")


def forward(kind):
    """The model's outputs on one batch, as one plain process computes them."""
    if kind == "mlp":
        return lambda model, batch: model(**batch[0])
    return lambda model, batch: model(batch[0][0], use_cache=False).logits


def loss(kind):
    """Class labels (the MLP) or next-token cross entropy (the Llama)."""
    if kind == "mlp":
        return lambda out, batch: F.cross_entropy(out, batch[1][0])

    def next_token(logits, batch):
        ids = batch[0][0]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               ids[:, 1:].reshape(-1))
    return next_token


def shard(value, run):
    rows = value.shape[0] // run.dp_size
    return value[run.dp_rank * rows:(run.dp_rank + 1) * rows]


def case(kind, options, batch=8, engine=None):
    cls, cfg = build(kind)
    model = initial(kind)
    state, buffers = model.state_dict(), dict(model.named_buffers())
    meta = make(kind, cls, cfg, "meta")
    inputs, targets = data(kind, batch)
    meta_inputs = {k: v.to("meta") for k, v in inputs.items()} if isinstance(inputs, dict) \
        else tuple(v.to("meta") for v in inputs)
    mesh = meshplan.Mesh.local(dist.get_world_size())
    common = dict(example_inputs=meta_inputs, example_targets=tuple(t.to("meta") for t in targets))
    plan = meshplan.autoparallel(meta, mesh, **common) if options == "auto" else \
        meshplan.manual_plan(meta, mesh, **common, **options)
    run = meshplan.parallelize(meta, plan, engine=engine)
    run.load_full_state_dict({**state, **buffers}, strict=False)
    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    local = {k: shard(v, run) for k, v in inputs.items()} if isinstance(inputs, dict) \
        else tuple(shard(v, run) for v in inputs)
    local_targets = tuple(shard(t, run) for t in targets)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(run.train_step(local, targets=local_targets))
        norms.append(run.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad()
    final = run.full_state_dict()
    run.eval()  # forward only, pipelines included (DECISIONS 54): this rank's rows
    out = run(local)
    run.train()
    return {"losses": losses, "norms": norms, "final": final, "eval": out, "kind": kind,
            "batch": batch, "dp_rank": run.dp_rank, "dp_size": run.dp_size,
            "engine": run.engine_name,
            "layout": f"{run.engine_name} engine, stages={plan.num_stages} "
                      f"mesh={list(plan.stages[0].mesh_shape)} zero={plan.stages[0].zero} "
                      f"dp={run.dp_size}"}


def _llama_dp2_tp2(engine: str):
    """The small Llama built on meta, planned dp=2 x tp=2 and parallelized on ``engine``."""
    cls, cfg = llama()
    meta = make("llama", cls, cfg, "meta")
    ids = torch.zeros(8, 8, dtype=torch.long, device="meta")
    plan = meshplan.manual_plan(meta, meshplan.Mesh.local(dist.get_world_size()),
                                example_inputs=(ids,), dp=2, tp=2)
    return cls, cfg, meshplan.parallelize(meta, plan, engine=engine)


def bad_inputs():
    """Each bad call must raise one DataError on every rank, with no hang."""
    cls, cfg, run = _llama_dp2_tp2("graph")
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except meshplan.MeshplanError as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    good = torch.zeros(4, 8, dtype=torch.long)
    attempt("uninitialized", lambda: run.train_step((good,)))
    state = {k: v for k, v in make("llama", cls, cfg, "cpu").state_dict().items()}
    attempt("missing_key", lambda: run.load_full_state_dict({}))
    run.load_full_state_dict(state, strict=False)
    run.init_weights(lambda m: None)  # buffers (rotary inv_freq) get values too
    attempt("shape", lambda: run.train_step((torch.zeros(8, 8, dtype=torch.long),)))
    attempt("dtype", lambda: run.train_step((torch.zeros(4, 8),)))
    attempt("targets", lambda: run.train_step((good,), targets=(good,)))
    # tensor-parallel peers given different data (indexed by global rank, a common bug)
    attempt("differs", lambda: run.train_step((torch.full((4, 8), dist.get_rank(),
                                                          dtype=torch.long),)))
    return errors


def bad_loads_modules():
    """The module engine's loads follow the same rules as the graph engine's (one state
    path, runtime/state.py): rank 0's mismatched state under broadcast_from_rank0 is one
    DataError on every rank (it was refused on rank 0 alone, the others waiting in the
    broadcast), and a meta weight missing from a strict=False load is refused at the step
    (it trained on to_empty's uninitialised memory)."""
    cls, cfg, run = _llama_dp2_tp2("modules")
    real = make("llama", cls, cfg, "cpu")
    state = {**real.state_dict(), **dict(real.named_buffers())}
    errors = {"engine": run.engine_name}
    try:
        run.load_full_state_dict({} if dist.get_rank() == 0 else None, broadcast_from_rank0=True)
        errors["broadcast_missing"] = None
    except meshplan.MeshplanError as exc:
        errors["broadcast_missing"] = f"{type(exc).__name__}: {exc}"
    # a pipeline: the head lives on stage 1 only, so only its ranks can see a wrong shape
    piped = meshplan.manual_plan(meta_pp := make("llama", cls, cfg, "meta"),
                                 meshplan.Mesh.local(dist.get_world_size()),
                                 example_inputs=(torch.zeros(8, 8, dtype=torch.long,
                                                             device="meta"),), dp=2, pp=2)
    run_pp = meshplan.parallelize(meta_pp, piped)
    wrong = {**state, "lm_head.weight": state["lm_head.weight"][:-1]}
    try:
        run_pp.load_full_state_dict(wrong if dist.get_rank() == 0 else None,
                                    broadcast_from_rank0=True)
        errors["broadcast_shape_pp"] = None
    except meshplan.MeshplanError as exc:
        errors["broadcast_shape_pp"] = f"{type(exc).__name__}: {exc}"
    run.load_full_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"},
                             strict=False)
    try:
        run.train_step((torch.zeros(4, 8, dtype=torch.long),))
        errors["partial"] = None
    except meshplan.MeshplanError as exc:
        errors["partial"] = f"{type(exc).__name__}: {exc}"
    return errors


def main():
    dist.init_process_group("gloo")
    out = {}
    cases = {
        "llama_dp2_tp2": ("llama", dict(dp=2, tp=2)),
        "llama_dp2_tp2_graph": ("llama", dict(dp=2, tp=2), "graph"),
        "mlp_dp2_tp2_graph": ("mlp", dict(dp=2, tp=2), "graph"),
        "llama_dp2_pp2": ("llama", dict(dp=2, pp=2)),
        "llama_zero1": ("llama", dict(dp=4, zero=1)),
        "mlp_dp4": ("mlp", dict(dp=4)),
        "mlp_dp2_tp2": ("mlp", dict(dp=2, tp=2)),
        "mlp_auto": ("mlp", "auto"),
    }
    for name, (kind, options, *engine) in cases.items():
        out[name] = case(kind, options, engine=engine[0] if engine else None)
    out["bad"] = bad_inputs()
    out["bad_modules"] = bad_loads_modules()
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
